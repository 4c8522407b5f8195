"""The round protocol's pure core: what a peer knows, and what it decides from it.

Nothing here does I/O, starts a thread or reads a clock: every function takes the records a peer
read, its own state and the time, and returns a decision with its reason. The driver
(:mod:`p2p_diloco.train.diloco`) reads the DHT and acts; the deterministic simulation
(:mod:`p2p_diloco.protocol.simulation`) drives the same functions in virtual time.

* :mod:`~p2p_diloco.protocol.phases`: a peer's phase, and the transitions allowed between phases;
* :mod:`~p2p_diloco.protocol.view`: the records a peer read, and every predicate over them, each defined once
  (at a step, on its way to a step, busy, averaging peers, vouchers);
* :mod:`~p2p_diloco.protocol.plans`: the decisions: load or train (:func:`~p2p_diloco.protocol.plans.plan_round`),
  whether to wait for the run's state, and with whom to average;
* :mod:`~p2p_diloco.protocol.trust`: whose word a state above this peer's is taken on;
* :mod:`~p2p_diloco.protocol.decide`: the move before a round, from all of the above: load a state, wait for the
  run's state, or train (:func:`~p2p_diloco.protocol.decide.next_move`), for the real peer, the keeper and the
  simulation alike;
* :mod:`~p2p_diloco.protocol.update_rule`: whether a round's mean is applied, clipped or void.
"""
