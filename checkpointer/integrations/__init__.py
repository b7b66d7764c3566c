"""Backends for training frameworks, built on the public ``checkpointer`` API only.

Each module imports its framework, which is an optional extra: ``checkpointer[torchtitan]`` for
:mod:`checkpointer.integrations.torchtitan`. Nothing here is imported by ``checkpointer`` itself.
"""
