"""Callbacks that trace a framework's training run: ``ampdoctor.integrations.transformers`` for
the Hugging Face ``Trainer`` and ``ampdoctor.integrations.lightning`` for Lightning."""
