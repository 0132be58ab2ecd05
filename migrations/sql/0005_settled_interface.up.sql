-- One current SQL source and a settled SQL interface.
--
-- From this revision on, the stored functions are defined in fastpubsub/sql/
-- and installed from there once a database reaches the head revision
-- (docs/schema.md, "Changing the SQL"); revisions change tables and indexes
-- and drop what the current source no longer defines. Here:
-- * publish_v2 becomes _publish, behind publish (payloads) and the new
--   publish_envelopes; consume_v2 becomes consume, cleanup_stuck_v2 becomes
--   cleanup_stuck (the v1 signatures of those two had other results); the _v2
--   names stay for one release as one-line wrappers (compat.sql);
-- * list_dlq returns consume's row shape (attributes and priority too);
-- * _advance_watermark_v2 becomes _advance_watermark; _filter_matches, which
--   nothing called, goes.

DROP FUNCTION IF EXISTS fastpubsub._advance_watermark_v2(fastpubsub.subscriptions);
DROP FUNCTION IF EXISTS fastpubsub._filter_matches(jsonb, jsonb);
DROP FUNCTION IF EXISTS fastpubsub.consume(text, text, integer);
DROP FUNCTION IF EXISTS fastpubsub.cleanup_stuck(integer);
DROP FUNCTION IF EXISTS fastpubsub.list_dlq(text, integer, integer);
