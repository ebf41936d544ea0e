"""Hugging Face names that moved, for the tests: transformers 5.25 renames gradient checkpointing to
activation checkpointing (the old names warn and go in v6; 5.17, the H200 image's, has only them)."""


def enable_checkpointing(model, use_reentrant: bool | None = None) -> None:
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
