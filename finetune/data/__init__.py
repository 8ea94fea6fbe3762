"""The data pipeline: recipe data sources → tokenized, labelled, packed rows → micro-batches.

One job per module: `sources` (files and saved datasets → records), `formats` (record → token ids and
labels), `overlength` (a record longer than max_seq_len → pieces, or cut, or an error), `packing`
(which documents share a row), `cache` (fingerprint and on-disk cache), `pipeline` (the steps in
order; one document per row), `collate` (a micro-batch of documents → tensors, packed or padded),
`sampler` (which documents form which micro-batch on which process, resumable).

Nothing is imported here: `python -m finetune.data.quickstart_pairs` needs none of the pipeline.

Example:
    from finetune.data.collate import collate_batch
    from finetune.data.pipeline import build_datasets
    bundle = build_datasets(recipe.data, tokenizer, seed=recipe.train.seed, log=print)
    batch = collate_batch([bundle.train[0], bundle.train[1]], pad_token_id=tokenizer.pad_token_id,
                          packing=recipe.data.packing, max_seq_len=recipe.data.max_seq_len)
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
"""
