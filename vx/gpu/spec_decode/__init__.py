"""Speculative decoding in the Worker: draft proposers (`ngram`) and the verification of
drafts against the target model's own samples (`verify`)."""
