"""`kvtier bench chaos`: a fault campaign under real load that proves no fault turns into a wrong
token, a lost request or a leak.

An in-process vLLM engine with kvtier's host + fs + obj (SeaweedFS) + redis tiers serves multi-turn
conversations at concurrency while injectors corrupt stored chunks and break processes; every reply
is compared with a reference computed by vLLM alone. One file per concept: `services` (the
campaign's redis-server and SeaweedFS), `media` (the tiers' storage seen from outside), `corrupt`
(the corruptions), `ledger` (every corruption's fate, and the spy on the tiers' jobs), `faults`
(the injector thread and the process faults), `reference` (the replies to expect), `driver` (the
load), `sampler` (process-tree resources, for the soak), `presets`, `runner` (one run), `report`
(summary, pass rule, table) and `cli`.
"""
