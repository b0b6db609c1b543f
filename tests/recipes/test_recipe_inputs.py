"""Bad recipe inputs: each gives one bounded line naming the value and the file, before anything is launched;
never a traceback, a runaway allocation or a silent wrong number. Ends with a fuzz test of the loader."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardline.plugins.grid import ParallelDims
from shardline.recipes.cli import main
from shardline.recipes.fit import RECIPES_DIR, machine_problems, model_state_bytes, run_fit
from shardline.recipes.lit_lm import LanguageModule
from shardline.recipes.schema import MAX_NODES, RecipeError, check_recipe, clip, load_recipe, short_repr

TINY = RECIPES_DIR / "tiny.yaml"
#: What the longest message may be: 20 problems of 400 characters, the file's name and separators.
MESSAGE_BOUND = 20 * 400 + 1000


def _tiny(**changes) -> dict:
    """tiny.yaml with ``changes`` (dotted paths: ``model.lr``) applied."""
    recipe = yaml.safe_load(TINY.read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = recipe
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return recipe


def _write(tmp_path: Path, content: dict | str | bytes, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return path


def _error(path: Path) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "\n" not in message and len(message) < MESSAGE_BOUND
    return message


STRATEGY = "trainer.strategy.init_args"


@pytest.mark.parametrize(("changes", "expected"), [
    ({f"{STRATEGY}.zero_stage": 5}, "trainer.strategy: invalid ZeRO settings: zero_stage=5 must be 0, 1, 2 or 3"),
    ({f"{STRATEGY}.collective_timeout": -5},
     "trainer.strategy: collective_timeout=-5 must be a positive number of seconds or a datetime.timedelta"),
    ({f"{STRATEGY}.collective_timeout": math.inf},
     "trainer.strategy: collective_timeout=inf must be a positive number of seconds or a datetime.timedelta "
     "(finite: with no timeout a hung rank is never named)"),
    ({f"{STRATEGY}.nonfinite_loss": "ignore"},
     "trainer.strategy: nonfinite_loss='ignore' must be one of ['raise', 'skip', 'off']"),
    ({f"{STRATEGY}.nonfinite_loss": "skip"},
     "trainer.strategy: nonfinite_loss='skip' with pp=2: the pipeline runs every micro-batch's backward"),
    ({"model.lr": math.inf}, "model.lr=inf must be a finite number"),
    ({"model.lr": math.nan}, "model.lr=nan must be a finite number"),
    ({"model.lr": -1}, "model.lr=-1 must be > 0"),
    ({"model.weight_decay": -0.1}, "model.weight_decay=-0.1 must be >= 0"),
    ({"model.rms_norm_eps": math.inf}, "model.rms_norm_eps=inf must be a finite number"),
    ({"model.optimizer": "adam"}, "model.optimizer='adam' must be one of ['adamw', 'cpu_adam', 'sgd']"),
    ({"trainer.precision": "16-mixed"},
     "trainer.precision='16-mixed' with trainer.strategy pp=2: fp16 loss scaling would apply twice on every "
     "stage but the last; use precision='bf16-mixed'"),
])
def test_bad_values_are_one_line_naming_field_and_file(tmp_path, changes, expected):
    path = _write(tmp_path, _tiny(**changes))
    message = _error(path)
    assert message.startswith(f"recipe {path}: ") and expected in message


def test_the_strategy_check_comes_before_jsonargparse(tmp_path, capsys):
    # Before: jsonargparse's 63-line traceback (rc 1) from instantiating the strategy. Now one line, rc 2.
    path = _write(tmp_path, _tiny(**{f"{STRATEGY}.zero_stage": 5}))
    assert main(["fit", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"shardline fit: error: recipe {path}: trainer.strategy: invalid ZeRO settings: zero_stage=5 "
                   "must be 0, 1, 2 or 3"]


def test_a_bad_override_is_caught_before_the_objects_are_built():
    with pytest.raises(RecipeError) as info:
        run_fit(["--config", str(TINY), f"--{STRATEGY}.collective_timeout", "-5"], run=False)
    message = str(info.value)
    assert message.startswith(f"recipe {TINY} with overrides ") and "\n" not in message
    assert "collective_timeout=-5.0 must be a positive number" in message or \
        "collective_timeout=-5 must be a positive number" in message


def test_a_constructor_error_jsonargparse_wraps_is_one_line(tmp_path):
    recipe = _tiny(**{"trainer.callbacks": [{"class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                                             "init_args": {"save_top_k": -5}}]})
    path = _write(tmp_path, recipe)
    with pytest.raises(RecipeError) as info:
        run_fit(["--config", str(path)], run=False)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"recipe {path} with overrides ")
    assert "cannot be built: Invalid value for save_top_k=-5" in message


def test_file_level_bounds(tmp_path):
    assert _error(_write(tmp_path, b"model:\n  lr: \xff\xfe\n")) == \
        f"recipe {tmp_path / 'recipe.yaml'}: not UTF-8 text: byte 0xff at line 2, column 7"
    deep = _error(_write(tmp_path, "[" * 100_000 + "]" * 100_000))  # before: RecursionError
    assert deep.endswith("not valid YAML at line 1, column 65: nested deeper than 64 levels")
    assert _error(_write(tmp_path, "a: &a [*a]\n")).endswith("not valid for a recipe: a recursive alias at line 1")
    assert _error(_write(tmp_path, "model:\n  lr: 1\x00\n")).endswith(
        "not valid YAML at line 2, column 8: character #x0000: special characters are not allowed")
    assert _error(_write(tmp_path, "#" * (2 << 20))).endswith("larger than 1048576 bytes, which no recipe is")


def _alias_bomb(levels: int) -> str:
    """Each level an anchor of 9 aliases of the one before: 9**levels values from ~40 bytes per level."""
    text = 'x0: &a0 ["x","x","x","x","x","x","x","x","x"]\n'
    for i in range(1, levels):
        text += f"x{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]\n"
    return text + f"model:\n  lr: *a{levels - 1}\n"


@pytest.mark.parametrize("levels", [8, 12])
def test_an_alias_bomb_is_refused_without_expanding_it(tmp_path, levels):
    # Before: the 8-level bomb (~300 bytes) printed a 226 MB error line; one level more ran out of memory.
    path = _write(tmp_path, _alias_bomb(levels))
    start = time.perf_counter()
    message = _error(path)
    assert time.perf_counter() - start < 5  # counted per node, never expanded
    expanded = int(re.search(r"its YAML aliases expand it to (\d+) values", message).group(1))
    assert expanded > 9 ** levels > MAX_NODES and f"more than the {MAX_NODES} a recipe may hold" in message


def test_aliases_within_bounds_still_load(tmp_path):
    text = TINY.read_text().replace("  seq_len: 128", "  seq_len: &width 128").replace("  d_model: 128",
                                                                                          "  d_model: *width")
    assert "*width" in text and load_recipe(_write(tmp_path, text))["model"]["d_model"] == 128


def test_messages_quote_values_short(tmp_path):
    long = "x" * 100_000
    message = _error(_write(tmp_path, _tiny(**{"model.n_layer": long, "data.path": long, long: 1})))
    assert "model.n_layer='xxxxxxxx" in message and "xxx' is a str, expected int" in message
    assert "is not a recipe section" in message and "x" * 100 not in message and len(message) < 1000
    assert short_repr(list(range(1000))).endswith("...]") and len(short_repr({i: i for i in range(1000)})) < 100
    assert clip("a\n   b " + "c" * 1000, 50) == "a b " + "c" * 26 + " ... " + "c" * 15


def test_model_states_closed_form():
    dims = ParallelDims(4, tp=2, pp=1)  # dp = 2
    adam32 = model_state_bytes(1000, dims, {"zero_stage": 1}, precision="32-true", optimizer="adamw")
    assert adam32 == {"device": 4 * 500 + 4 * 500 + 8 * 500 / 2, "cpu": 0}  # weights, gradients, moments / dp
    bf16_z3 = model_state_bytes(1000, dims, {"zero_stage": 3, "offload_optimizer": "cpu"}, precision="bf16-mixed",
                                optimizer="adamw")
    assert bf16_z3 == {"device": (2 + 2) * 500 / 2, "cpu": 12 * 500 / 2}


def test_a_model_larger_than_this_machine_is_refused_before_launch(tmp_path, capsys):
    # Before: d_model=1048576 passed every check and each rank went on to build 26 T parameters.
    recipe = _tiny(**{"model.d_model": 1 << 20})
    check_recipe(recipe, source="r.yaml")  # the file alone: a recipe may be written for another machine
    (problem,) = machine_problems(recipe)
    assert problem.startswith("model (n_layer=2, d_model=1048576, d_ff=4194304, vocab_size=256): "
                              "26,388,711,079,936 parameters, whose weights, gradients and optimizer states need "
                              "at least 384.0 TiB of RAM for the 4 ranks on this node (4 model-parallel parts, "
                              "ZeRO-1 over dp*cp=1, precision 32-true); this machine has ")
    assert problem.endswith(" available")
    assert machine_problems(_tiny()) == []  # the packaged recipe fits
    # the fit command runs it on the configuration it launches, before anything is built
    path = _write(tmp_path, recipe)
    assert main(["fit", "--config", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"shardline fit: error: recipe {path} with overrides ['--config', '{path}']: model (")


def test_the_module_refuses_the_same_values():
    from shardline.plugins.errors import ContractError

    with pytest.raises(ContractError, match=r"^LanguageModule: lr=inf must be a finite number$"):
        LanguageModule(lr=math.inf)


# --- fuzz: the loader the fit command runs before launch ---------------------------------------------------------

YAMLISH = st.text(alphabet=st.sampled_from(list("abz019 -:[]{},&*!|>'\"#\n\t.~?%@`") + ["\x00", "\ufeff", "é"]),
                  max_size=200)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=True),
                    st.text(max_size=30))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
FIELDS = st.sampled_from(["model.lr", "model.n_layer", "model.d_model", "model.n_head", "model.vocab_size",
                          "model.architecture", "model.optimizer", "model.init_from", "model.dropout",
                          "data.batch_size", "data.path", "trainer.devices", "trainer.precision", "trainer.strategy",
                          f"{STRATEGY}.tp", f"{STRATEGY}.pp", f"{STRATEGY}.zero_stage", f"{STRATEGY}.micro_batches",
                          f"{STRATEGY}.offload_optimizer", f"{STRATEGY}.collective_timeout", f"{STRATEGY}.sp",
                          f"{STRATEGY}.nonfinite_loss", "trainer", "model", "seed_everything", "ckpt_path", "x"])


def _load_or_recipe_error(path: Path) -> None:
    try:
        recipe = load_recipe(path)
    except RecipeError as error:
        assert "\n" not in str(error) and len(str(error)) < MESSAGE_BOUND
    else:
        assert isinstance(recipe, dict)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=YAMLISH, prefix=st.sampled_from(["", "model:\n  lr: ", "trainer:\n  strategy: ", "a: &a "]))
def test_fuzz_yamlish_bytes_give_a_recipe_or_one_recipe_error(tmp_path, text, prefix):
    _load_or_recipe_error(_write(tmp_path, (prefix + text).encode()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(FIELDS, VALUES, min_size=1, max_size=3))
def test_fuzz_nested_values_give_a_recipe_or_one_recipe_error(tmp_path, changes):
    recipe = yaml.safe_load(TINY.read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = recipe
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[last] = value
    _load_or_recipe_error(_write(tmp_path, recipe))
