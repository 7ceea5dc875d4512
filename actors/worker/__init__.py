"""The model worker (a Ray actor) and its engine: sessions, the prefix cache, bursts and the direct
link between workers."""
