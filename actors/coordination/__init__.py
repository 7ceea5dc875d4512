"""The coordinator (a Ray actor) and what it runs: the step scheduler, the decoding plan, the
strategies' machines, output, metrics, step costs and prompt scoring."""
