"""The team of daemons: what spans nodes.

- ``membership`` — which peers are alive (heartbeats in, a view out); pure.
- ``commit`` — the global commit protocol as a state machine: events in, messages and actions out; pure.
- ``holders`` — who holds a node's redundancy: replica holders and parity groups (failure-domain aware); pure.
- ``decide`` — which copy a restore reads, which run, the newest whole step, where to heal to; pure.
- ``stripes`` — parity by units: the rotating rows of a group, accumulation and recovery; pure.
- ``parts`` — a rank's part as the team moves it: used bytes, run, manifest off the wire, check on arrival.
- ``team`` — the driver the daemon plugs in (its commit policy): feeds the state machines, carries out their outputs.
- ``replicate`` — the replication thread: copies our parts to their holders, heals after a loss.
- ``view``, ``counters`` — what a part may read of the team (``TeamView``), and each part's counters.
- ``serve``, ``serve_held``, ``serve_parity`` — the peer request server (each part registers its
  handlers), the answers about the copies held here, the parity group's.
- ``sources`` — finding a version across the team and bringing its bytes here, checked.
- ``directory`` — what every live node holds, gathered by recursive doubling in a large team.
- ``shmfiles`` — the private shm files a reader fills: ranges reserved up front, removed quietly.
- ``flush_plan``, ``flush_lead``, ``flush_share`` — the flush every node writes: the plan, the lead, a writer.
- ``gossip``, ``liveness`` — SWIM membership, and which membership a daemon runs.
- ``status`` — the team as ``ucpd status`` shows it.
- ``parity_group`` — ``--parity``: this node's side of its group (send units, hold blocks, rebuild).
- ``replicas`` — copies of other nodes' parts held in this node's RAM.
- ``config`` — ``TeamConfig``, the team flags of ``ucpd serve``.
- ``transport`` — ZeroMQ links between daemons: authenticated envelopes, heartbeats, bulk frames.
"""
