"""The what-if and the findings as entry points: the analyses they read from other modules (the critical path,
the pipeline bubbles, the collective bandwidth) computed here and given to them, so that no analysis calls
another's entry point (``analyses`` is a star around the attribution)."""

from __future__ import annotations

import warnings

import pandas as pd

from ..analyses.bubbles import pipeline_bubbles
from ..analyses.critical_path import critical_path
from ..analyses.findings import DEFAULT_RULES, evaluate
from ..analyses.scenario import Context
from ..analyses.traffic import bandwidth_rows
from ..analyses.what_if import predict
from ..attribution.core import attribute
from ..base.errors import TraceWarning

__all__ = ["context_of", "evaluate_findings", "what_if"]


def what_if(source, scenario) -> pd.DataFrame:
    """Predicted step times of ``source`` (a ``TraceSet``, an events table or an ``Attribution``) under
    ``scenario`` (a ``Scenario``, its text, or a list of them): ``analyses.what_if.RESULT_COLUMNS``, per
    scenario by step, the whole step (rank -1) first (see ``analyses.what_if``)."""
    return predict(context_of(attribute(source, caller="what_if")), scenario)


def context_of(attribution) -> Context:
    """The one ``analyses.scenario.Context`` of ``attribution`` (kept on it): its critical path and its
    pipeline bubbles given to ``Context.build``."""
    return attribution.derived(_build)


def _build(attribution) -> Context:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)  # the analyses give them to their own callers
        chain = critical_path(attribution)
    return Context.build(attribution, chain=chain, bubbles=lambda: _quiet_bubbles(attribution))


def _quiet_bubbles(attribution) -> pd.DataFrame:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bubbles' own warnings, given to their callers
        return pipeline_bubbles(attribution)


def evaluate_findings(attribution, sections, *, rules=DEFAULT_RULES) -> pd.DataFrame:
    """``analyses.findings.evaluate`` of ``attribution`` and its report's ``sections``, given the what-if and
    the collective bandwidth rows of the attribution."""
    return evaluate(attribution, sections, rules=rules, what_if=lambda scenario: what_if(attribution, scenario),
                    bandwidth_rows=lambda: bandwidth_rows(attribution))
