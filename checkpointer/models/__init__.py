"""Model and optimizer helpers: how a model's state is named, how an optimizer's is laid out, and
how a Hugging Face checkpoint fills a model (:mod:`.hf_load`)."""
