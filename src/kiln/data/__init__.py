"""Data: the bundled corpus, tokenizers, token shards and the loaders that read them."""
