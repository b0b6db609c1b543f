"""``shardline plan``: which layout fits, how fast it runs and why, before a GPU-hour is spent.

    shardline plan --model MODEL --gpus N --gpus-per-node G --gpu NAME --seq S --global-batch B
                   [--interconnect NAME] [--nics-per-node K] [--cluster NODE] [--catalog YAML]
                   [--layout tp=..,pp=..,dp=..,cp=..,chunks=..,zero=..,offload=..,recompute=..,
                             micro_batches=..,micro_batch_size=..,sp=..,schedule=..]
                   [--headroom SHARE] [--top K] [--json] [--explain] [--emit RECIPE.yaml] [--calibrate PROFILE]
                   [--compare PROFILE_DIR [--recipe RUN.yaml] [--warmup W]
                    [--format text|md|html|json|csv|parquet|tensorboard]]

MODEL is a packaged name, a Hugging Face ``config.json`` (or its folder) or a YAML of architecture fields (a
``shardline fit`` recipe works). The cluster is ``--cluster`` (a packaged node type) or ``--gpu`` with the node
type of that GPU in the catalog supplying the links; ``--gpus-per-node``, ``--interconnect`` and
``--nics-per-node`` override. Errors are one line on stderr naming the bad value, exit status 2; a layout that
does not fit is a row saying so (exit status 1 when no row fits). A row over the usable HBM (``--headroom``,
default 10% kept for the CUDA caching allocator's fragmentation) but within the HBM is "tight": listed, never
picked while a row fits. Rows within the step-time model's error band (3.44%) of the fastest are ties: the
pick is the simplest of them, the others printed as "equivalent: ..."; ``--explain`` says why the pick beats the
next rows, category by category, and whether more nodes, a longer sequence or another GPU would change it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from shardline.plugins.errors import ShardlineError


def add_commands(sub) -> None:
    p = sub.add_parser("plan", help="which layout fits, how fast, and why (memory + step-time model + search)",
                       description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="packaged name, Hugging Face config.json (or folder), or a YAML of architecture "
                                   "fields")
    p.add_argument("--gpus", type=int, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the node type's)")
    p.add_argument("--gpu", help="GPU name in the catalog (a100-40gb, a100-80gb, h100-sxm, h200, b200, mi300x)")
    p.add_argument("--cluster", help="a packaged node type instead of --gpu (dgx-h100, dgx-a100-80gb, ...)")
    p.add_argument("--interconnect", help="the inter-node link (ib-hdr, ib-ndr, ib-xdr, roce; default: the node "
                                          "type's)")
    p.add_argument("--nics-per-node", type=int, help="NICs per node (default: the node type's)")
    p.add_argument("--catalog", help="a YAML merged over the packaged hardware catalog")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the model's seq_len)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--layout", default="", help="fix some or all fields: tp=8,pp=4,zero=1,recompute=full,...")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp8"))
    p.add_argument("--attention", default="flash", choices=("flash", "materialized"))
    p.add_argument("--headroom", type=float, default=None, help="share of HBM kept free for the CUDA caching "
                   "allocator's fragmentation (default 0.10); a row over it but within the HBM is 'tight'")
    p.add_argument("--cpu-ram-gib", type=float, default=None, help="CPU RAM per node, to check offload against")
    p.add_argument("--deepspeed-config", metavar="DS.json", help="the run's DeepSpeed config (JSON, as the "
                   "strategy reads it): the memory estimate and the step model follow its ZeRO-3 sub-group and NVMe "
                   "offload settings (default: a --recipe's deepspeed_config, else DeepSpeed's defaults; this flag "
                   "wins over the recipe's)")
    p.add_argument("--top", type=int, default=10, help="rows to print (0: all)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--explain", action="store_true", help="why the pick beats the next rows, category by category, "
                   "and what more nodes, a longer sequence or another GPU would pick (JSON: 'explain')")
    p.add_argument("--emit", metavar="RECIPE.yaml", help="write the best fitting layout as a shardline fit recipe")
    p.add_argument("--calibrate", metavar="PROFILE", help="replace the catalog's rates by those measured in a "
                                                           "shardline profile of your own run")
    p.add_argument("--compare", metavar="PROFILE_DIR", help="predicted vs measured, per rank and category, for "
                                                             "the layout of that run (--layout or --recipe)")
    p.add_argument("--recipe", help="the shardline fit recipe of the profiled run (model, layout, GPUs, batch)")
    p.add_argument("--warmup", type=int, default=0, help="--compare: measured steps to leave out at the start")
    p.add_argument("--format", default=None, choices=("text", "md", "html", "json", "csv", "parquet", "tensorboard"),
                   help="--compare's report format (default text; json with --json)")
    p.add_argument("--output", "-o", help="write the --compare report or the plan JSON here instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ShardlineError as error:
        print(f"shardline plan: error: {error}", file=sys.stderr)
        return 2


def _cluster(args, catalog):
    from shardline.recipes.planning.catalog import PlanError, cluster

    if args.cluster:
        base = catalog.cluster(args.cluster)
        if args.gpu and args.gpu != base.gpu.name:
            raise PlanError(f"--gpu {args.gpu!r} contradicts --cluster {args.cluster!r} (its GPU is "
                            f"{base.gpu.name!r}); give one of them")
        name = args.cluster
        entry = catalog.clusters[args.cluster]
    elif args.gpu:
        catalog.gpu(args.gpu)  # unknown GPU: the catalog's error, naming the known ones
        typed = [n for n, c in catalog.clusters.items() if c["gpu"] == args.gpu]
        entry = catalog.clusters[typed[0]] if typed else {"gpu": args.gpu, "gpus_per_node": 8,
                                                           "inter_node": "ib-ndr", "nics_per_node": 8}
        name = None
    else:
        raise PlanError("give --gpu NAME or --cluster NODE")
    fields = {k: v for k, v in entry.items()}
    if args.gpus_per_node is not None:
        fields["gpus_per_node"] = args.gpus_per_node
    if args.interconnect:
        fields["inter_node"] = args.interconnect
    if args.nics_per_node is not None:
        fields["nics_per_node"] = args.nics_per_node
    changed = any(getattr(args, k) is not None for k in ("gpus_per_node", "interconnect", "nics_per_node"))
    if name and not changed:
        return catalog.cluster(name)
    gpu = fields.pop("gpu")
    label = f"{fields['gpus_per_node']}x{gpu}"
    return cluster(catalog, gpu=gpu, name=label, **fields)


def _from_recipe(path: str):
    """(model spec, layout fields, gpus, global batch, the strategy's deepspeed_config or None) of a shardline fit
    recipe."""
    import yaml

    from shardline.recipes.planning.catalog import PlanError
    from shardline.recipes.planning.emit import layout_of
    from shardline.recipes.planning.models import from_mapping
    from shardline.recipes.schema import strategy_arguments

    try:
        recipe = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise PlanError(f"--recipe {path}: cannot be read ({error})") from None
    if not isinstance(recipe, dict):
        raise PlanError(f"--recipe {path}: not a recipe mapping")
    lay = layout_of(recipe)
    trainer = recipe.get("trainer") or {}
    gpus = int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))
    spec = from_mapping(recipe.get("model") or {}, name=Path(path).stem, source=path)
    init_args = strategy_arguments(trainer.get("strategy")) or {}  # layout_of accepted its spelling
    ds = init_args.get("deepspeed_config")  # a path: from the working folder, as the fit command reads it
    return spec, lay, gpus, lay.global_batch, ds


def _zero_settings(config, flag: str):
    """The estimate's :class:`~.memory.ZeroSettings` from a DeepSpeed config: a mapping, or a JSON file read as
    ``shardline fit`` reads it (``HybridParallelStrategy(deepspeed_config=PATH)``: JSON, the path as given)."""
    import json

    from shardline.recipes.planning.catalog import PlanError
    from shardline.recipes.planning.memory import DEFAULT_ZERO, ZeroSettings

    if config is None:
        return DEFAULT_ZERO
    source = flag
    if not isinstance(config, dict):
        source = f"{flag} {config}"
        try:
            config = json.loads(Path(config).read_text())
        except OSError as error:
            raise PlanError(f"{source}: cannot be read ({error})") from None
        except json.JSONDecodeError as error:
            raise PlanError(f"{source}: not valid JSON: line {error.lineno}: {error.msg}") from None
    return ZeroSettings.from_deepspeed(config, source=source)


def _run(args) -> int:
    import contextlib
    import dataclasses

    from shardline.recipes.planning import search
    from shardline.recipes.planning.catalog import PlanError, load_catalog
    from shardline.recipes.planning.models import load_model

    catalog = load_catalog(args.catalog)
    recipe_layout, recipe_ds = None, None
    if args.recipe:
        spec, recipe_layout, gpus, batch, recipe_ds = _from_recipe(args.recipe)
        model = load_model(args.model) if args.model else spec
        args.gpus = gpus if args.gpus is None else args.gpus
        args.global_batch = batch if args.global_batch is None else args.global_batch
    else:
        if not args.model:
            raise PlanError("give --model MODEL (a packaged name, a config.json or a YAML) or --recipe RUN.yaml")
        model = load_model(args.model)
    missing = [flag for flag, value in (("--gpus", args.gpus), ("--global-batch", args.global_batch))
               if value is None]
    if missing:
        raise PlanError(f"give {' and '.join(missing)}")
    cl = _cluster(args, catalog)
    calibration = None
    if args.calibrate:
        from shardline.recipes.planning.calibrate import calibrate

        calibration = calibrate(args.calibrate, cl)
        cl = calibration.cluster
        print(calibration.summary(), file=sys.stderr)
    seq = model.seq_len if args.seq is None else args.seq
    if args.top < 0:
        raise PlanError(f"--top {args.top} must be >= 0 (0: every row)")
    fixed = search.parse_layout(args.layout)
    if recipe_layout is not None:
        fixed = {**dataclasses.asdict(recipe_layout), **fixed}
    zero = (_zero_settings(args.deepspeed_config, "--deepspeed-config") if args.deepspeed_config else
            _zero_settings(recipe_ds, f"--recipe {args.recipe}: trainer.strategy.init_args.deepspeed_config"))
    if args.compare:
        return _compare(args, model, cl, seq, fixed, zero)
    kwargs = {} if args.headroom is None else {"headroom": args.headroom}
    result = search.plan(model, cl, gpus=args.gpus, seq_len=seq, global_batch=args.global_batch, layout=fixed,
                         dtype=args.dtype, attention=args.attention, cpu_ram_gib=args.cpu_ram_gib, zero=zero,
                         **kwargs)
    top = args.top if args.top and args.top > 0 else None
    explained = search.explain(result, catalog=catalog) if args.explain and result.ties else None
    if args.json:
        doc = result.to_json(top)
        if explained is not None:
            doc["explain"] = explained
        text = json.dumps(doc, indent=1, default=float)
    else:
        text = search.format_table(result, top=top or 0)
        if explained is not None:
            text += "\n\n" + search.format_explain(result, explained)
        elif args.explain:
            text += "\n\nno row fits: nothing to explain"
    if args.output:
        Path(args.output).write_text(text + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text)
    if args.emit:
        from shardline.recipes.planning.emit import recipe_yaml

        row = result.pick
        command = "shardline plan " + " ".join(shlex.quote(a) for a in _reproducer(args))
        # Checking the recipe builds the strategy, whose first import of DeepSpeed logs to stdout: stdout is the
        # plan (--json), so that line goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            emitted = recipe_yaml(model, row, cl, gpus=args.gpus, seq_len=seq, global_batch=args.global_batch,
                                  command=command, deepspeed_config=args.deepspeed_config or recipe_ds)
        Path(args.emit).write_text(emitted)
        print(f"wrote {args.emit}: {search.describe(row.layout)}", file=sys.stderr)
    return 0 if result.fitting else 1


def _reproducer(args) -> list[str]:
    out = []
    for flag in ("model", "recipe", "gpus", "gpus_per_node", "gpu", "cluster", "interconnect", "nics_per_node",
                 "catalog", "calibrate", "seq", "global_batch", "layout", "dtype", "attention", "headroom",
                 "cpu_ram_gib", "deepspeed_config"):
        value = getattr(args, flag)
        if value in (None, "") or (flag == "dtype" and value == "bf16") or (flag == "attention"
                                                                            and value == "flash"):
            continue
        out += ["--" + flag.replace("_", "-"), str(value)]
    return out + ["--emit", args.emit]


def _compare(args, model, cl, seq, fixed, zero) -> int:
    from shardline.recipes.planning.catalog import PlanError
    from shardline.recipes.planning.compare import compare
    from shardline.recipes.planning.layout import PlanLayout
    from shardline.recipes.planning.search import check_fixed

    needed = ("tp", "pp", "cp")
    missing = [k for k in needed if k not in fixed]
    if missing:
        raise PlanError(f"--compare needs the run's layout: give --recipe RUN.yaml or --layout with "
                        f"{', '.join(missing)} (and dp, zero, micro_batches, micro_batch_size as the run had)")
    check_fixed(model, fixed, args.gpus)
    if "dp" not in fixed:
        fixed["dp"] = args.gpus // (fixed["tp"] * fixed["pp"] * fixed["cp"])
    if fixed.get("chunks", 1) > 1:
        fixed.setdefault("schedule", "interleaved")  # as the search reads chunks
    try:
        layout = PlanLayout(**fixed)
    except ShardlineError as error:
        raise PlanError(f"--layout: {error}") from None
    result = compare(args.compare, model, layout, cl, seq_len=seq, warmup=args.warmup, zero=zero)
    fmt = args.format or ("json" if args.json else "text")
    if fmt in ("parquet", "tensorboard"):
        if not args.output:
            raise PlanError(f"--format {fmt} needs -o " + ("FILE" if fmt == "parquet" else "LOGDIR"))
        (result.to_parquet if fmt == "parquet" else result.to_tensorboard)(args.output)
        print(f"wrote {args.output}", file=sys.stderr)
        return 0
    text = {"text": result.to_text, "md": result.to_markdown, "html": result.to_html, "json": result.to_json,
            "csv": lambda: result.to_csv()}[fmt]()
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text)
    return 0


__all__ = ["add_commands", "run"]
