-- Back to revision 0012_jit_off: the one function this revision added goes.
DROP FUNCTION fastpubsub._publish_handoff(text[], text[], boolean[], text[], text[], integer[]);
