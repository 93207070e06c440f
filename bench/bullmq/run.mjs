// agq-bench's BullMQ peer: the bench's workload on BullMQ (this process is
// the client side: producers and workers) against a redis-server the bench
// started (the server side, measured by the bench from /proc).
//
// Started by bench/src/bullmq_peer.rs as
//   node run.mjs --port P --workers W --concurrency S --jobs M --batch K \
//     --payload-bytes B --clients C [--rate R] [--paced-secs N] [--timeout-secs T]
// (every flag also reads BULLMQ_BENCH_<FLAG> from the environment, e.g.
// BULLMQ_BENCH_PORT). Runs a peak phase (closed loop: C producers, each
// Queue.addBulk'ing batches of K jobs back to back, or open loop at --rate
// jobs/s when given), then, unless --paced-secs is 0 or --rate was given, a
// phase offered half of the peak's end-to-end rate, open loop, for
// --paced-secs seconds.
//
// Stdout is newline-delimited JSON, nothing else:
//   {"event":"mark","phase":"peak"|"paced","at":"start"|"end"}
//     right before a phase's first submit and right after its last
//     completion (the bench reads redis-server's CPU at these marks);
//   {"event":"result","node":..,"bullmq":..,"peak":{..},"paced":{..}|null}
//     last, the figures (see phaseResult below);
//   {"event":"error","message":..}
//     instead of the result when the run could not go on (exit status 1).
// Diagnostics go to stderr.
//
// Semantics, chosen to match the Redis-list peer: each job's data is
// {action_id, plan_id, i, t, payload} with t the submit time in µs (this
// process's monotonic clock); jobs are kept once completed or failed
// (removeOnComplete / removeOnFail false, BullMQ's default: the result
// stays in Redis, like the peer's `job:<id>` result), one attempt, the
// worker's name stored on every job it takes. The processor does nothing
// but return the task result the other systems report.
//
// Measured here: enqueue-to-lease = the processor's start minus t;
// completion ack = from the processor's return to the worker's
// 'completed' event (BullMQ's moveToFinished round trip, which also
// fetches the worker's next job); end-to-end = first submit to the last
// 'completed' event; client CPU = process.cpuUsage() of this process.

import { readFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { parseArgs } from 'node:util';

import { Queue, Worker } from 'bullmq';

const QUEUE = 'bench';
/** The task result every system's worker reports (agq_load::task_result). */
const TASK_RESULT = {
  task_number: 1,
  command: 'true',
  exit_code: 0,
  stdout: 'ok\n',
  stderr: '',
  duration_ms: 0,
};
/** Producers of an open-loop phase (the Redis peer's submit pool). */
const PACED_PRODUCERS = 8;
/** Longest wait for the workers and queues to close at the end, ms. */
const CLOSE_MS = 5000;

/** Microseconds on this process's monotonic clock. */
function nowUs() {
  return Math.round(performance.now() * 1000);
}

function emit(obj) {
  process.stdout.write(`${JSON.stringify(obj)}\n`);
}

/** Writes the error event and exits with status 1 once stdout is flushed. */
function fail(message) {
  process.stdout.write(`${JSON.stringify({ event: 'error', message: String(message) })}\n`, () =>
    process.exit(1),
  );
  setTimeout(() => process.exit(1), 2000).unref();
}

process.on('uncaughtException', (e) => fail(`uncaught: ${e?.stack ?? e}`));
process.on('unhandledRejection', (e) => fail(`unhandled rejection: ${e?.stack ?? e}`));

const FLAGS = {
  port: { type: 'string' },
  host: { type: 'string', default: '127.0.0.1' },
  workers: { type: 'string', default: '64' },
  concurrency: { type: 'string', default: '4' },
  jobs: { type: 'string', default: '200000' },
  batch: { type: 'string', default: '100' },
  'payload-bytes': { type: 'string', default: '128' },
  clients: { type: 'string', default: '4' },
  rate: { type: 'string', default: '0' },
  'paced-secs': { type: 'string', default: '5' },
  'timeout-secs': { type: 'string', default: '300' },
};

/** The flags, each defaulting to BULLMQ_BENCH_<FLAG> and then to FLAGS. */
function options() {
  const { values } = parseArgs({ options: FLAGS, strict: true, allowPositionals: false });
  const get = (name) => {
    const env = process.env[`BULLMQ_BENCH_${name.toUpperCase().replaceAll('-', '_')}`];
    if (process.argv.some((a) => a === `--${name}` || a.startsWith(`--${name}=`))) {
      return values[name];
    }
    return env ?? values[name];
  };
  const int = (name, min) => {
    const v = Number(get(name));
    if (!Number.isInteger(v) || v < min) {
      throw new Error(`--${name} must be an integer >= ${min}, got ${get(name)}`);
    }
    return v;
  };
  const num = (name) => {
    const v = Number(get(name));
    if (!Number.isFinite(v) || v < 0) {
      throw new Error(`--${name} must be a number >= 0, got ${get(name)}`);
    }
    return v;
  };
  return {
    host: get('host'),
    port: int('port', 1),
    workers: int('workers', 1),
    concurrency: int('concurrency', 1),
    jobs: int('jobs', 1),
    batch: int('batch', 1),
    payloadBytes: int('payload-bytes', 0),
    clients: int('clients', 1),
    rate: num('rate'),
    pacedSecs: num('paced-secs'),
    timeoutSecs: num('timeout-secs') || 300,
  };
}

/** Latency samples (µs) of one phase, summarised in ms. */
class Samples {
  constructor() {
    this.buf = new Float64Array(1024);
    this.n = 0;
  }

  add(us) {
    if (this.n === this.buf.length) {
      const bigger = new Float64Array(this.buf.length * 2);
      bigger.set(this.buf);
      this.buf = bigger;
    }
    this.buf[this.n++] = Math.max(1, us);
  }

  /** {count, p50_ms, p99_ms, max_ms}: nearest-rank percentiles. */
  summary() {
    const n = this.n;
    if (n === 0) {
      return { count: 0, p50_ms: 0, p99_ms: 0, max_ms: 0 };
    }
    const s = this.buf.slice(0, n).sort();
    const at = (q) => s[Math.min(n - 1, Math.max(0, Math.ceil(q * n) - 1))] / 1000;
    return { count: n, p50_ms: at(0.5), p99_ms: at(0.99), max_ms: s[n - 1] / 1000 };
  }
}

/** What the workers record during one phase. */
class Recorder {
  constructor() {
    this.reset(Infinity);
  }

  reset(target) {
    this.target = target;
    this.leased = 0;
    this.completed = 0;
    this.errors = 0;
    this.lastError = null;
    this.lastDoneUs = 0;
    this.lease = new Samples();
    this.ack = new Samples();
    this.onDone = null;
  }

  error(what) {
    this.errors += 1;
    this.lastError = String(what);
  }

  /** Resolves once `target` completions are in, or false at `deadlineMs`. */
  waitDone(deadlineMs) {
    if (this.completed >= this.target) {
      return Promise.resolve(true);
    }
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        this.onDone = null;
        resolve(false);
      }, Math.max(0, deadlineMs - performance.now()));
      this.onDone = () => {
        clearTimeout(timer);
        this.onDone = null;
        resolve(true);
      };
    });
  }

  completedAt(returnedUs, now) {
    if (returnedUs !== undefined) {
      this.ack.add(now - returnedUs);
    }
    this.completed += 1;
    this.lastDoneUs = Math.max(this.lastDoneUs, now);
    if (this.completed >= this.target && this.onDone) {
      this.onDone();
    }
  }
}

/** The jobs of action `a` (jobs a*k ..), submitted at `t` µs. */
function batch(a, k, t, payload) {
  const ts = String(t);
  const jobs = new Array(k);
  for (let j = 0; j < k; j++) {
    jobs[j] = {
      name: QUEUE,
      data: { action_id: `action-${a}`, plan_id: 'bench', i: String(a * k + j), t: ts, payload },
      opts: { removeOnComplete: false, removeOnFail: false, attempts: 1 },
    };
  }
  return jobs;
}

async function submitAction(queue, a, k, payload) {
  await queue.addBulk(batch(a, k, nowUs(), payload));
}

/** Closed loop: each of `queues` adds the next action as soon as its last returned. */
async function submitClosedLoop(queues, actions, k, payload) {
  let next = 0;
  await Promise.all(
    queues.map(async (q) => {
      for (;;) {
        const a = next++;
        if (a >= actions) {
          return;
        }
        await submitAction(q, a, k, payload);
      }
    }),
  );
}

/** Open loop: action a is due at start + a*K/rate, taken by the first free producer. */
async function submitPaced(queues, actions, k, rate, payload) {
  const periodMs = (k / Math.max(rate, 1)) * 1000;
  const pending = [];
  const idle = [...queues];
  const running = new Set();
  let failure = null;
  const dispatch = () => {
    while (idle.length > 0 && pending.length > 0) {
      const q = idle.pop();
      const a = pending.shift();
      const p = submitAction(q, a, k, payload)
        .catch((e) => {
          failure ??= e;
        })
        .finally(() => {
          running.delete(p);
          idle.push(q);
          dispatch();
        });
      running.add(p);
    }
  };
  const start = performance.now();
  for (let a = 0; a < actions && failure === null; a++) {
    const wait = start + a * periodMs - performance.now();
    if (wait > 0) {
      await new Promise((r) => setTimeout(r, wait));
    }
    pending.push(a);
    dispatch();
  }
  // Every action is dispatched or pending; wait for the pool to drain
  // (each finished submit dispatches the next pending one).
  while (running.size > 0 && failure === null) {
    await Promise.race(running);
  }
  if (failure !== null) {
    throw failure;
  }
}

/** Rejects after `ms`, with `what` in the message (the timer does not hold the process). */
function deadline(ms, what) {
  return new Promise((_, reject) => {
    setTimeout(() => reject(new Error(`${what} did not finish within ${ms / 1000} s`)), ms).unref();
  });
}

/**
 * One phase: `jobs` jobs (rounded up to whole actions of `k`), closed loop
 * from `clients` producers, or paced at `rate` jobs/s when > 0.
 */
async function phase(name, opts, queues, rec, jobs, rate) {
  const k = opts.batch;
  const actions = Math.ceil(jobs / k);
  jobs = actions * k;
  const payload = 'x'.repeat(opts.payloadBytes);
  rec.reset(jobs);
  const timeoutMs = opts.timeoutSecs * 1000;
  const deadlineMs = performance.now() + timeoutMs;
  emit({ event: 'mark', phase: name, at: 'start' });
  const cpu0 = process.cpuUsage();
  const t0 = nowUs();
  let submitEnd = t0;
  let finished = false;
  try {
    const submit =
      rate > 0
        ? submitPaced(queues.slice(0, PACED_PRODUCERS), actions, k, rate, payload)
        : submitClosedLoop(queues.slice(0, opts.clients), actions, k, payload);
    await Promise.race([submit, deadline(timeoutMs, 'submitting')]);
    submitEnd = nowUs();
    finished = await rec.waitDone(deadlineMs);
    if (!finished) {
      rec.error(`only ${rec.completed} of ${jobs} jobs completed within ${opts.timeoutSecs} s`);
    }
  } catch (e) {
    rec.error(`submit: ${e?.message ?? e}`);
    if (submitEnd === t0) {
      submitEnd = nowUs();
    }
  }
  const cpu = process.cpuUsage(cpu0);
  emit({ event: 'mark', phase: name, at: 'end' });
  return {
    finished,
    result: {
      jobs,
      completed: rec.completed,
      leased: rec.leased,
      submit_secs: (submitEnd - t0) / 1e6,
      e2e_secs: (rec.lastDoneUs > t0 ? rec.lastDoneUs - t0 : 0) / 1e6,
      rate,
      lease: rec.lease.summary(),
      ack: rec.ack.summary(),
      client_cpu_secs: (cpu.user + cpu.system) / 1e6,
      errors: rec.errors,
      last_error: rec.lastError,
    },
  };
}

/** Closes `things` (workers, queues), giving up after CLOSE_MS. */
async function closeAll(things) {
  const closing = Promise.allSettled(things.map((t) => t.close()));
  await Promise.race([closing, new Promise((r) => setTimeout(r, CLOSE_MS).unref())]);
}

async function main() {
  const opts = options();
  const connection = { host: opts.host, port: opts.port, maxRetriesPerRequest: null };
  const rec = new Recorder();
  const returned = new Map();
  // The no-op processor of worker `workerId`: records the lease, returns
  // the task result (BullMQ then stores it as the job's return value).
  const processor = (workerId) => async (job) => {
    const now = nowUs();
    rec.leased += 1;
    const t = Number(job.data?.t);
    if (Number.isFinite(t)) {
      rec.lease.add(now - t);
    }
    returned.set(job.id, nowUs());
    return { status: 'completed', worker_id: workerId, task_results: [TASK_RESULT] };
  };
  const workers = [];
  const queues = [];
  const setupMs = opts.timeoutSecs * 1000;
  const setup = async () => {
    for (let w = 0; w < opts.workers; w++) {
      const name = `bullmq-worker-${w}`;
      const worker = new Worker(QUEUE, processor(name), {
        connection,
        concurrency: opts.concurrency,
        name,
        autorun: true,
      });
      worker.on('completed', (job) => {
        const sent = returned.get(job.id);
        returned.delete(job.id);
        rec.completedAt(sent, nowUs());
      });
      worker.on('failed', (job, err) => rec.error(`job ${job?.id} failed: ${err?.message ?? err}`));
      worker.on('error', (err) => rec.error(`worker ${w}: ${err?.message ?? err}`));
      workers.push(worker);
    }
    for (let c = 0; c < Math.max(opts.clients, PACED_PRODUCERS); c++) {
      const queue = new Queue(QUEUE, { connection });
      queue.on('error', (err) => rec.error(`queue ${c}: ${err?.message ?? err}`));
      queues.push(queue);
    }
    await Promise.all([...workers, ...queues].map((x) => x.waitUntilReady()));
  };
  await Promise.race([setup(), deadline(setupMs, 'connecting the workers and queues')]);
  let bullmq = 'unknown';
  try {
    const pkg = new URL('./node_modules/bullmq/package.json', import.meta.url);
    bullmq = JSON.parse(readFileSync(pkg, 'utf8')).version;
  } catch {
    // the version is informative only
  }
  const peak = await phase('peak', opts, queues, rec, opts.jobs, opts.rate);
  let paced = null;
  if (opts.rate === 0 && opts.pacedSecs > 0 && peak.finished && peak.result.e2e_secs > 0) {
    const r = peak.result.completed / peak.result.e2e_secs / 2;
    const jobs = Math.floor(Math.max(r * opts.pacedSecs, opts.batch));
    paced = (await phase('paced', opts, queues, rec, jobs, r)).result;
  }
  await new Promise((resolve) =>
    process.stdout.write(
      `${JSON.stringify({ event: 'result', node: process.version, bullmq, peak: peak.result, paced })}\n`,
      resolve,
    ),
  );
  await closeAll([...workers, ...queues]);
  process.exit(0);
}

main().catch((e) => fail(e?.stack ?? e));
