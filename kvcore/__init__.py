"""The pure KV core of inferscale: the tensor math of memory injection, engine-agnostic.

Lives here: rotary embedding (`rope`), context-window encoding of facts (`encoding`), the fact KV record
and its on-disk format (`record`, `safetensors_io`), model fingerprints (`fingerprint`) and the
composition of records into an injectable prefix (`compose`).

May import: torch, numpy and the standard library only. Models and tokenizers come in through the small
protocols in `protocols`; adapters for transformers, vLLM, Ray or Redis live in other packages and
import this one, never the reverse (tests/core/test_purity.py enforces it).
"""
