-- JIT off where planner options are set: every function that sets
-- plan_cache_mode or switches an enable_* option off now also says
-- SET jit = off. On PostgreSQL 14-17 a switched-off plan node is costed at
-- ten billion, so those statements always passed jit_above_cost and a server
-- built with LLVM compiled them on every call (docs/schema.md). No table
-- changes: the functions are installed from the source at the head.
SELECT 1;
