"""Recipe validation: every bad field is named together with the file, before anything is built; command-line
overrides go through LightningCLI (real parser, real instantiation, no training) and are checked too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from shardline.recipes.cli import main
from shardline.recipes.fit import RECIPES_DIR, resolve_recipe, run_fit
from shardline.recipes.schema import RecipeError, load_recipe

TINY = RECIPES_DIR / "tiny.yaml"
HYBRID = "shardline.plugins.lightning.strategy.HybridParallelStrategy"


def _write(tmp_path: Path, recipe: dict | str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe if isinstance(recipe, str) else yaml.safe_dump(recipe))
    return path


def _tiny_with(**sections) -> dict:
    recipe = yaml.safe_load(TINY.read_text())
    for section, fields in sections.items():
        if isinstance(fields, dict):
            recipe.setdefault(section, {}).update(fields)
        else:
            recipe[section] = fields
    return recipe


def test_packaged_tiny_recipe_is_valid_and_resolvable():
    recipe = load_recipe(TINY)
    assert recipe["trainer"]["devices"] == 4 and recipe["trainer"]["strategy"]["init_args"]["tp"] == 2
    assert resolve_recipe("tiny") == str(TINY) == resolve_recipe("tiny.yaml")
    with pytest.raises(RecipeError, match=r"recipe nope: no such file.*packaged: \[.*'tiny'"):
        resolve_recipe("nope")


@pytest.mark.parametrize(("sections", "fragments"), [
    (dict(model={"n_layr": 2}), ["model.n_layr is not a LanguageModule argument (did you mean model.n_layer?)"]),
    (dict(model={"n_layer": "two"}), ["model.n_layer='two' is a str, expected int"]),
    (dict(model={"lr": True}), ["model.lr=True is a bool, expected float"]),
    (dict(data={"batch_size": 2.5, "pth": "x"}),
     ["data.batch_size=2.5 is a float, expected int", "data.pth is not a TextDataModule argument"]),
    (dict(data={"seq_len": 64}), ["data.seq_len is not a recipe field: it follows model.seq_len"]),
    (dict(trainer={"max_step": 3}), ["trainer.max_step is not a Trainer argument (did you mean trainer.max_steps?)"]),
    (dict(trainer={"enable_progress_bar": "yes"}), ["trainer.enable_progress_bar='yes' is a str"]),
    (dict(trainer={"strategy": {"class_path": HYBRID, "init_args": {"tp": "2", "zero_stag": 1}}}),
     ["trainer.strategy.init_args.tp='2' is a str, expected int",
      "trainer.strategy.init_args.zero_stag is not a HybridParallelStrategy argument (did you mean "
      "trainer.strategy.init_args.zero_stage?)"]),
    (dict(modle={}), ["'modle' is not a recipe section", "(did you mean model?)"]),
    (dict(seed_everything="abc"), ["seed_everything='abc' is a str, expected int | bool"]),
    (dict(trainer={"strategy": {"class_path": HYBRID, "init_args": {"tp": 2, "stage": 3}}}),
     ["trainer.strategy.init_args.stage is a DeepSpeedStrategy argument that HybridParallelStrategy ignores"]),
])
def test_keys_and_types_are_named_with_the_file(tmp_path, sections, fragments):
    path = _write(tmp_path, _tiny_with(**sections))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert message.startswith(f"recipe {path}: ")
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(("sections", "fragment"), [
    (dict(trainer={"devices": 6}),
     "trainer.devices=6 x trainer.num_nodes=1 with trainer.strategy {'tp': 2, 'pp': 2, 'cp': 1, 'sp': 'none'}: "
     "invalid parallel layout: world_size=6 is not divisible by tp*cp*pp = 2*1*2 = 4"),
    (dict(trainer={"devices": 2, "num_nodes": 2, "strategy": "shardline_tp8_zero1"}),
     "world_size=4 is not divisible by tp*cp*pp = 8*1*1 = 8"),
    (dict(trainer={"strategy": "shardline_tp3"}), "trainer.strategy: strategy name 'shardline_tp3': tp=3 not in"),
    (dict(model={"n_head": 3, "d_model": 96}), "n_head=3 is not divisible by tp=2"),
    (dict(model={"n_head": 3}), "model: invalid GPTConfig: d_model=128 is not divisible by n_head=3"),
    (dict(model={"vocab_size": 100}), "model.vocab_size=100 is below the byte vocabulary (256)"),
    (dict(data={"path": "/no/such/corpus"}), "data.path='/no/such/corpus' does not exist"),
    (dict(data={"batch_size": 12}),
     "data.batch_size=12 is not divisible by trainer.strategy.init_args.micro_batches=8"),
    (dict(model={"n_layer": 1}, trainer={"devices": 8, "strategy": {
        "class_path": HYBRID, "init_args": {"tp": 2, "pp": 4, "zero_stage": 1}}}),
     "model.n_layer=1: the pipeline cuts its n_layer + 2 = 3 layers (embedding, blocks, head) into "
     "pp*chunks = 4*1 = 4 non-empty stages"),
    (dict(trainer={"callbacks": [{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}]}),
     "trainer.callbacks[0].class_path='lightning.pytorch.callbacks.LearningRateMonitor' is a class of the "
     "lightning namespace, but shardline fit runs pytorch_lightning (the two are different classes): use "
     "pytorch_lightning.callbacks.LearningRateMonitor"),
])
def test_impossible_layouts_and_shapes_name_the_values(tmp_path, sections, fragment):
    path = _write(tmp_path, _tiny_with(**sections))
    with pytest.raises(RecipeError, match=f"^recipe {re.escape(str(path))}: .*{re.escape(fragment)}"):
        load_recipe(path)


def test_yaml_syntax_and_shape_errors(tmp_path):
    with pytest.raises(RecipeError, match=r"recipe .*recipe\.yaml: not valid YAML at line 3, column 12"):
        load_recipe(_write(tmp_path, "model:\n  n_layer: 2\n    d_model: 3\n"))
    with pytest.raises(RecipeError, match="must be a mapping of sections"):
        load_recipe(_write(tmp_path, "- just\n- a list\n"))
    with pytest.raises(RecipeError, match="model must be a mapping of LanguageModule arguments, got int 3"):
        load_recipe(_write(tmp_path, "model: 3\n"))
    with pytest.raises(RecipeError, match="cannot be read"):
        load_recipe(tmp_path / "missing.yaml")


def test_command_line_overrides_reach_the_built_objects():
    cli = run_fit(["--config", "tiny", "--model.n_layer", "3", "--model.seq_len", "64",
                   "--trainer.strategy.init_args.tp", "1", "--trainer.strategy.init_args.zero_stage", "2",
                   "--data.batch_size", "24", "--trainer.max_steps", "7"], run=False)
    assert cli.model.hparams.n_layer == 3 and cli.model.config.seq_len == 64
    assert cli.datamodule.seq_len == 64 and cli.datamodule.batch_size == 24  # data.seq_len follows the model
    strategy = cli.trainer.strategy
    assert strategy.degrees == {"tp": 1, "pp": 2, "cp": 1} and strategy.zero_stage == 2
    assert strategy.layout_for(4).dp == 2 and cli.trainer.max_steps == 7
    assert cli.model.hparams.d_model == 128  # untouched fields keep the recipe's value


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["--trainer.devices", "3"], "trainer.devices=3 x trainer.num_nodes=1"),
    (["--model.n_head", "3", "--model.d_model", "96"], "n_head=3 is not divisible by tp=2"),
    (["--model.n_layer", "two"], "model.n_layer"),
    (["--trainer.strategy.init_args.tpp", "2"], "tpp"),
    (["--trainer.strategy.init_args.stage", "3"], "trainer.strategy.init_args.stage has no effect"),
])
def test_bad_overrides_are_recipe_errors_naming_file_and_field(overrides, fragment):
    with pytest.raises(RecipeError) as info:
        run_fit(["--config", str(TINY), *overrides], run=False)
    message = str(info.value)
    assert message.startswith(f"recipe {TINY} with overrides ") and fragment in message


def test_the_command_prints_one_error_line_and_exits_2(tmp_path, capsys):
    path = _write(tmp_path, _tiny_with(model={"n_layr": 2}))
    assert main(["fit", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardline fit: error: recipe ") and "model.n_layr" in err and str(path) in err


def test_fit_without_a_recipe_is_refused_and_help_is_lightning_clis(capsys):
    assert main(["fit", "--trainer.max_steps", "1"]) == 2
    assert "shardline fit needs --config RECIPE" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--model.n_layer" in out and "--data.batch_size" in out


def test_in_process_call_that_would_relaunch_workers_is_refused():
    # Lightning re-runs sys.argv (here: pytest's) to start ranks 1..3; refuse before any worker starts.
    with pytest.raises(RecipeError, match="re-running this command line"):
        run_fit(["--config", "tiny", "--trainer.max_steps", "1"])
