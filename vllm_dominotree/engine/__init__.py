"""The vLLM side of DominoTree: worker, runner, proposer, tree attention and acceptance
inside the engine. Imported only inside vLLM's engine processes; it applies the
worker-side patches (patches/), which import nothing from here."""
