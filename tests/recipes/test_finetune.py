"""Fine-tuning a Hugging Face checkpoint through Lightning: a tiny random ``LlamaForCausalLM`` and a byte-level
BPE tokenizer, both built here with ``transformers`` and ``tokenizers`` into one folder, trained with
``shardline fit --config llama_tiny --model.init_from FOLDER`` (a real subprocess, tp2 on 2 CPU ranks): the data
is tokenised with the folder's tokenizer, the first step's loss equals transformers' own loss on that batch, and
the loss falls. Plus the recipe checks that read the folder."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from shardline.plugins.lightning.strategy import HybridParallelStrategy
from shardline.plugins.testing import run_ranks
from shardline.recipes.data import TextDataModule, tokenize, tokenizer_file
from shardline.recipes.fit import RECIPES_DIR
from shardline.recipes.schema import RecipeError, check_recipe, load_recipe

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

STEPS, SEQ, BATCH, VOCAB = 8, 32, 8, 300
TEXT = Path(__file__).resolve().parents[2] / "plugins"  # a small corpus: our own sources


def _make_checkpoint(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [p.read_text() for p in sorted(TEXT.rglob("*.py"))]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf-llama")
    _make_checkpoint(folder)
    return folder


def test_the_data_module_tokenises_with_the_checkpoints_tokenizer(checkpoint):
    assert tokenizer_file(checkpoint) == checkpoint / "tokenizer.json"
    assert tokenizer_file(TEXT) is None  # a folder without one: bytes
    data = TextDataModule(path=str(TEXT), seq_len=SEQ, batch_size=BATCH, tokenizer=str(checkpoint))
    data.setup("fit")
    ids, targets = data.train_set[0]
    assert ids.dtype == torch.int64 and int(ids.max()) < VOCAB and torch.equal(ids[1:], targets[:-1])
    from tokenizers import Tokenizer

    from shardline.recipes.data import corpus_files, read_corpus

    corpus = read_corpus(corpus_files(str(TEXT)), max_bytes=data.max_bytes)
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    expected = tokenizer.encode(corpus.decode("utf-8", errors="replace"), add_special_tokens=False).ids
    assert tokenize(corpus, checkpoint / "tokenizer.json").tolist() == expected
    assert ids.tolist() == expected[:SEQ]  # windows are cut from the encoded corpus, in order


def test_recipe_checks_read_the_checkpoint(checkpoint, tmp_path):
    recipe = load_recipe(RECIPES_DIR / "llama_tiny.yaml")
    recipe["model"]["init_from"] = str(checkpoint)
    check_recipe(recipe, source="llama_tiny + init_from")  # 4 query heads and 2 KV heads fit tp=2
    recipe["trainer"]["strategy"]["init_args"].update(tp=3, pp=1)
    recipe["trainer"]["devices"] = 3
    with pytest.raises(RecipeError, match="model vs trainer.strategy: n_head=4 is not divisible by tp=3"):
        check_recipe(recipe, source="tp4")
    recipe["model"]["init_from"] = str(tmp_path)
    with pytest.raises(RecipeError, match=r"model.init_from: .*no config.json"):
        check_recipe(recipe, source="empty folder")


def _first_batch_loss_by_transformers(checkpoint: Path) -> float:
    """transformers' own loss on the first training batch the fit run sees (seeded sampler, 1 replica)."""
    data = TextDataModule(path=str(TEXT), seq_len=SEQ, batch_size=BATCH, tokenizer=str(checkpoint))
    data.setup("fit")
    # DistributedSampler: seed = PL_GLOBAL_SEED (the recipe seed_everything), epoch 0
    g = torch.Generator().manual_seed(1234)
    order = torch.randperm(len(data.train_set), generator=g)[:BATCH]
    ids = torch.stack([data.train_set[int(i)][0] for i in order])
    targets = torch.stack([data.train_set[int(i)][1] for i in order])
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


@pytest.mark.slow
def test_shardline_fit_fine_tunes_a_hugging_face_checkpoint(checkpoint, tmp_path, run_command):
    command = [sys.executable, "-m", "shardline.recipes.cli", "fit", "--config", "llama_tiny",
               "--model.init_from", str(checkpoint), "--model.seq_len", str(SEQ), "--data.path", str(TEXT),
               "--data.batch_size", str(BATCH), "--trainer.devices", "2", "--trainer.strategy.init_args.pp", "1",
               "--model.lr", "0.01", "--model.warmup_steps", "1",
               "--trainer.max_steps", str(STEPS), "--trainer.limit_val_batches", "1",
               "--trainer.val_check_interval", str(STEPS), "--trainer.log_every_n_steps", "1",
               "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    result = run_command(command, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "these recipe fields are not used" in result.stdout  # the recipe's shape yields to config.json
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = sorted((tmp_path / "runs").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train_loss")]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    # Step 0 is the checkpoint's own function on the tokenised batch: transformers' loss (float32, tp2: rtol 1e-4).
    assert losses[0] == pytest.approx(_first_batch_loss_by_transformers(checkpoint), rel=1e-4)
    assert losses[-1] < losses[0]


def _fit_from_checkpoint(rank, world, folder, kwargs):
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from shardline.plugins.lightning.strategy import HybridParallelStrategy
    from shardline.plugins.testing import adopt_process_group_in_lightning
    from shardline.recipes.lit_lm import LanguageModule

    class First(pl.Callback):
        loss = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            First.loss = First.loss or float(outputs["loss"])

    adopt_process_group_in_lightning()
    strategy = HybridParallelStrategy(**kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[First()])
    ids, targets = _zero3_batch()
    dp = strategy.layout_for(world).dp
    trainer.fit(LanguageModule(architecture="llama", init_from=folder),
                DataLoader(torch.utils.data.TensorDataset(ids, targets), batch_size=BATCH // dp, shuffle=False))
    return First.loss


def _zero3_batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@pytest.mark.parametrize("kwargs", [dict(zero_stage=3), dict(tp=2, zero_stage=3), dict(pp=2, zero_stage=3)],
                         ids=["dp2-zero3", "tp2-zero3", "pp2-zero3"])
def test_init_from_under_zero3_starts_from_the_checkpoints_function(checkpoint, kwargs):
    # configure_model runs inside deepspeed.zero.Init: each rank materialises its part, which ZeRO-3 then
    # partitions over the data-parallel ranks. The first loss is the checkpoint's (transformers' own forward).
    ids, targets = _zero3_batch()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(input_ids=ids).logits.flatten(0, 1),
                                                     targets.flatten()).item()
    losses = run_ranks(_fit_from_checkpoint, 2, str(checkpoint), kwargs, timeout=300)
    dp = HybridParallelStrategy(**kwargs).layout_for(2).dp
    mean = sum(losses) / len(losses) if dp > 1 else losses[0]  # dp2: the two replicas' halves of the batch
    assert mean == pytest.approx(expected, rel=1e-5)  # float32 behind TP/PP/DP reductions
