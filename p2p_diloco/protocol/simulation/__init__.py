"""A deterministic simulation of a swarm that runs the protocol's real core in virtual time.

As FoundationDB and TigerBeetle test their protocols: every source of nondeterminism (time, read delays,
missed reads, stores that land late, crashes, joins, freezes, partitions, hostile records) comes from one
seeded :class:`random.Random`, so a failing seed replays exactly, and invariants are checked after every
event. The peers decide with the same functions a real peer does (:mod:`p2p_diloco.protocol`: the round plan,
the trust rules, the membership plan, the update check), and their groups aggregate with the real robust rule
(:func:`p2p_diloco.sync.robust.aggregate`) and apply the real Nesterov step on small pseudo-gradients whose
norm grows with the inner steps a peer holds, so what a void round does to the next one shows.

* :mod:`.loop`: virtual time, processes as generators;
* :mod:`.dht`: records with per-reader delays, missed reads, late stores, TTL expiry and partitions;
* :mod:`.averager`: rounds that form from the membership plan, commit, fail when a member dies, or are void;
* :mod:`.peer`: one peer's loop, as :class:`p2p_diloco.train.diloco.DiLoCoPeer` runs it;
* :mod:`.invariants`: what must hold after every event;
* :mod:`.schedule`: a seed's faults and arrivals, and the named scenarios of races CI found before;
* :mod:`.swarm`: one simulated run, and its report.

``python benchmarks/simulate.py --peers N --seeds K`` runs it.
"""
