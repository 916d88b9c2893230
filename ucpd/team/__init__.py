"""The team of daemons: what spans nodes.

- ``membership`` — which peers are alive (heartbeats in, a view out); pure.
- ``commit`` — the global commit protocol as a state machine: events in, messages and actions out; pure.
- ``placement`` — where a node's replicas and parity groups go (failure-domain aware); pure.
- ``stripes`` — parity by units: the rotating rows of a group, accumulation and recovery; pure.
- ``parity_group`` — ``--parity``: this node's side of its group (send units, hold blocks, rebuild).
- ``replicas`` — copies of other nodes' parts held in this node's RAM.
- ``config`` — ``TeamConfig``, the team flags of ``ucpd serve``.
- ``transport`` — ZeroMQ links between daemons: authenticated envelopes, heartbeats, bulk frames.
- ``team`` — the glue the daemon plugs in: replication, the commit policy, restore sources from peers.
"""
