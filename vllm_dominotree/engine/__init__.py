"""The vLLM side of DominoTree: config translation, worker, runner, proposer, tree
attention and acceptance inside the engine. Imported only inside vLLM processes."""
