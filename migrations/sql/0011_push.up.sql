-- Push subscriptions: a subscription may carry a push configuration (an HTTPS
-- endpoint that `fastpubsub push-worker` delivers its messages to, signed per
-- Standard Webhooks) and its signing secrets (fastpubsub/sql/schema.sql says
-- what each column holds). create_subscription and update_subscription take
-- them as the options push and push_secret (_subscription_options lists them)
-- and rotate_push_secret is new: all installed from the source at the head.

ALTER TABLE fastpubsub.subscriptions
    ADD COLUMN push jsonb,
    ADD COLUMN push_secret text,
    ADD COLUMN push_previous_secret text,
    ADD COLUMN push_previous_secret_until timestamptz,
    ADD CONSTRAINT subscriptions_push_endpoint CHECK (
        push IS NULL OR coalesce(jsonb_typeof(push) = 'object' AND jsonb_typeof(push -> 'endpoint') = 'string', false)),
    ADD CONSTRAINT subscriptions_push_secret CHECK ((push IS NULL) = (push_secret IS NULL));
