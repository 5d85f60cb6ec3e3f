"""The core every target shares: the spec's axes (axes), one variant's facts (variant), the
argument contract (contract), the result types (results), the variant lookup (registry) and the
op layer that registers, checks and differentiates every op (ops)."""
