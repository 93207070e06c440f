-- AGQ schema, version 6: whether a worker runs its tasks in the kernel
-- sandbox (1) or was started with --insecure-no-sandbox (0). Plans with
-- require_sandbox are scheduled only on sandboxed workers.
ALTER TABLE workers ADD COLUMN sandboxed INTEGER NOT NULL DEFAULT 0;
