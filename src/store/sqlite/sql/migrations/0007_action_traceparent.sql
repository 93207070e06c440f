-- AGQ schema, version 7: the W3C trace context (`traceparent`) of the
-- SubmitAction that created an action, sent with each of its jobs' leases
-- so the worker's spans join the submitter's trace. NULL: not traced.
ALTER TABLE actions ADD COLUMN traceparent TEXT;
