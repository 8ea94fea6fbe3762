"""The catalog's offline continued-pretraining recipe: raw text (licence texts shipped in `data/licences/`)
on the embedded base, with the output head and the input embeddings adapting at their own learning rate.

It is run as users run it, from the repository root, for a few steps only: the held-out loss must drop.
"""

from __future__ import annotations

from pathlib import Path

from finetune.catalog import catalog_names, resolve_recipe_path
from finetune.commands.recipes import catalog_entries
from finetune.recipe import load_recipe
from finetune.training.loop import train

REPO = Path(__file__).resolve().parents[1]
RECIPE = "tiny-llama-continued-pretraining"


def test_the_catalog_has_it_for_the_embedded_base_with_head_embeddings_and_data_in_the_repository():
    assert RECIPE in catalog_names()
    (entry,) = [entry for entry in catalog_entries() if entry.name == RECIPE]
    assert (entry.base, entry.method) == ("embedded:tiny-llama", "lora")
    recipe = load_recipe(resolve_recipe_path(RECIPE))
    assert recipe.data.format == "text"
    assert recipe.lora.train_lm_head and recipe.lora.train_embed_tokens
    assert recipe.train.embedding_lr is not None and recipe.train.embedding_lr != recipe.train.lr
    sources = [*recipe.data.train, *recipe.data.validation]
    assert len(sources) == 2 and all((REPO / source.path).is_file() for source in sources)  # offline, shipped


def test_a_few_steps_of_it_lower_the_held_out_loss(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # its data paths are relative to the repository root, as the quickstart's
    overrides = [
        "train.max_steps=4",
        "train.save_every_steps=null",
        f"output.dir={tmp_path / 'adapter'}",
        f"output.run_dir={tmp_path / 'run'}",
        "output.report=false",
    ]
    adapter, metrics = train(RECIPE, overrides, log=lambda message: None)
    assert (adapter / "adapter_model.safetensors").is_file()
    assert metrics["base_eval_loss"] > 6.0  # licence prose is new to a base pretrained on Python source
    assert metrics["eval_loss"] < metrics["base_eval_loss"] - 0.5, metrics
