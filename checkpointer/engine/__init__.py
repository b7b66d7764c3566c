"""Save, load and unshard over ``torch.distributed`` and a :class:`~checkpointer.storage.Storage`."""
