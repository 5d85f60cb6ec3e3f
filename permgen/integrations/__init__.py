"""permgen inside other frameworks: `permgen.integrations.megatron` for megatron-core."""
