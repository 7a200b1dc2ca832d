"""Static analyses over the IR that feed the contract (they prove, they do not transform)."""
