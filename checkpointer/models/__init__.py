"""Model and optimizer helpers: how a model's state is named, and how an optimizer's is laid out."""
