-- AGQ schema, version 11: fleet scheduling.
--
-- An action's jobs lease by priority (higher first; `jobs.priority` is
-- the action's unless a RetryJob changed it), only on workers whose tags
-- match its worker selector (the action's own, else its plan's default,
-- stored in canonical form; empty: any worker), and at most `max_running`
-- of all jobs sharing its concurrency key run at once (empty key: no
-- limit, max_running 0). Every action and job of an older database has
-- priority 0, no selector and no key.
ALTER TABLE actions ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
ALTER TABLE actions ADD COLUMN worker_selector TEXT NOT NULL DEFAULT '';
ALTER TABLE actions ADD COLUMN concurrency_key TEXT NOT NULL DEFAULT '';
ALTER TABLE actions ADD COLUMN max_running INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
