"""Decoding strategies as state machines without I/O: the one implementation of each strategy.

A machine decodes one request. Each *iteration* it says what the models must do (:meth:`needs`: a
list of :data:`Need` values), and it consumes what they returned (:meth:`consume`, results
aligned with the needs), returning the tokens that became final. It never calls a model and
never touches a KV cache; who executes the needs is up to the driver:

* the reference loops (:mod:`verifiers.reference`, :mod:`verifiers.reference.ensemble`)
  execute them with :class:`verifiers.reference.executor.LocalExecutor`, recomputing every row from the
  full context (slow, obviously correct; the exactness tests enumerate their output law);
* the serving engine (``actors.coordination.scheduler``) gathers the needs of every request in flight and
  runs them as one batched call per model worker per scheduler step (each running request
  makes one iteration per step).

Both drivers run the same machine, so what is proven exact is what serves.

Random streams. Every draw belongs to one stream of the request's layout
(:func:`verifiers.randomness.stream_seeds`): :meth:`~verifiers.machines.base.DecodeMachine.streams` says which model's
executor owns which stream (draws of a need happen where the need is executed, next to the
rows), and ensemble machines own their verification stream themselves (``own_source``). A
need names the stream it draws from; executors draw in the order each need's docstring
(:mod:`verifiers.machines.needs`) states, which is what makes a request's tokens independent of its neighbours in a batch.

Vocabulary: ``append`` is always the committed tokens the model has not been told about yet
(the model's executor commits them before doing the need); ``queued`` tokens are unverified.

Modules: :mod:`verifiers.machines.needs` (what a machine asks of the models and what they
return), :mod:`verifiers.machines.base` (:class:`~verifiers.machines.base.DecodeMachine`),
then one module per strategy: :mod:`verifiers.machines.autoregressive` (``ar``),
:mod:`verifiers.machines.speculative` (``sd`` / ``multi_draft``), :mod:`verifiers.machines.ensemble`
(``ensemble`` and ``se`` with member proposals) and :mod:`verifiers.machines.ensemble_draft`
(``se`` with a draft proposer).
"""
