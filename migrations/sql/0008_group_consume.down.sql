-- Back to revision 0007: _consume_batch goes.

DROP FUNCTION IF EXISTS fastpubsub._consume_batch(text[], text[], integer[]);
