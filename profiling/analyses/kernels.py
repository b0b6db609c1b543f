"""The top kernels (or ops) per category: a summary of the attributed work rows that no other analysis gives
(a section of ``report_sections``)."""

from __future__ import annotations

import pandas as pd

from ..attribution.core import per_rank_work

TOP_KERNELS = 5


def _kernel_totals(work: pd.DataFrame) -> pd.DataFrame:
    work = work[work["category"].astype(str) != ""]
    per = work.groupby([work["category"].astype(str).rename("category"), work["name"].astype(str).rename("name")])
    return per["dur_ns"].agg(["size", "sum"]).reset_index()


def top_kernels(source, *, top: int = TOP_KERNELS) -> pd.DataFrame:
    """The ``top`` names by total time in each category, over the attributed work rows of all ranks: category,
    name, calls, total_ns, mean_ns, share (of the category's total)."""
    per_rank = per_rank_work(source, _kernel_totals, columns=("category", "name", "dur_ns"))
    if per_rank is None or per_rank.empty:
        return pd.DataFrame(columns=["category", "name", "calls", "total_ns", "mean_ns", "share"])
    per = per_rank.groupby(["category", "name"], as_index=False)[["size", "sum"]].sum()
    per.columns = ["category", "name", "calls", "total_ns"]
    per["mean_ns"] = per["total_ns"] / per["calls"]
    per["share"] = per["total_ns"] / per.groupby("category")["total_ns"].transform("sum").where(
        lambda s: s > 0)
    per = per.sort_values(["category", "total_ns", "name"], ascending=[True, False, True])
    return per.groupby("category").head(top).reset_index(drop=True)
