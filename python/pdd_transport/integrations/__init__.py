"""Adapters that plug pdd_transport into inference engines.

Each submodule imports its engine lazily and only when imported itself:
``import pdd_transport`` (and ``import pdd_transport.integrations``) never imports an
engine. ``pdd_transport.integrations.vllm`` holds vLLM's KV connector (docs/vllm.md).
"""
