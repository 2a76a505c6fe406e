// Graphile Worker's side of bench/pg_peers.py: one process doing one
// shape, told when to start on stdin, reporting on stdout (the protocol is
// in bench/pg_peers_drivers.py's docstring).
//
//   node graphile.mjs MODE [ARGS]   with BENCH_DATABASE_URL and
//                                   GRAPHILE_WORKER_DIR (where npm installed it)
//
// Graphile Worker is imported from the folder the bench installed it in, not
// from next to this file: the bench never vendors it.

import { createRequire } from "node:module";
import { createInterface } from "node:readline";
import { pathToFileURL } from "node:url";

const require = createRequire(`${process.env.GRAPHILE_WORKER_DIR}/`);
const gw = await import(pathToFileURL(require.resolve("graphile-worker")).href);
const pg = require("pg");

const connectionString = process.env.BENCH_DATABASE_URL;
// A line per job on the console would cost more than the no-op job.
const logger = new gw.Logger(() => () => {});
const payload = { p: "x".repeat(90) };

// The configuration of Graphile Worker's performance page (0.16 on): 24
// concurrent jobs, a pool of 25, a local queue of 500 jobs fetched at once,
// completions and failures batched (a delay of 0 ms: whatever completes in
// the same tick goes in one statement).
const WORKER = {
  concurrentJobs: 24,
  localQueue: { size: 500 },
  completeJobBatchDelay: 0,
  failJobBatchDelay: 0,
};
const POOL_SIZE = 25;

const stdin = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
async function readLine() {
  const next = await stdin.next();
  return next.done ? null : next.value;
}
function say(line) {
  process.stdout.write(`${line}\n`);
}
function now() {
  // CLOCK_MONOTONIC, the clock Python's time.monotonic_ns reads.
  return process.hrtime.bigint().toString();
}

async function utils() {
  const u = await gw.makeWorkerUtils({ connectionString, logger });
  await u.withPgClient((client) => client.query("SELECT 1"));
  return u;
}

// A pool with every connection open, so the drain's clock does not count
// connecting.
async function warmPool() {
  const pool = new pg.Pool({ connectionString, max: POOL_SIZE });
  const clients = await Promise.all(Array.from({ length: POOL_SIZE }, () => pool.connect()));
  for (const client of clients) client.release();
  return pool;
}

function runner(pgPool, taskList) {
  return gw.run({ pgPool, logger, noHandleSignals: true, taskList, preset: { worker: WORKER } });
}

const modes = {
  async migrate() {
    const u = await utils();
    await u.migrate();
    await u.release();
    say("done");
  },

  async single(count) {
    const u = await utils();
    say("ready");
    await readLine();
    for (let i = 0; i < Number(count); i++) await u.addJob("enq", payload);
    say("done");
    await readLine();
    await u.release();
  },

  async batch(count, size, task) {
    const u = await utils();
    const specs = Array.from({ length: Number(size) }, () => ({ identifier: task, payload }));
    say("ready");
    await readLine();
    for (let i = 0; i < Number(count); i++) await u.addJobs(specs);
    say("done");
    await readLine();
    await u.release();
  },

  async drain(count) {
    const pool = await warmPool();
    let done = 0;
    let finished;
    const all = new Promise((resolve) => {
      finished = resolve;
    });
    say("ready");
    await readLine();
    const r = await runner(pool, {
      noop: async () => {
        if (++done === Number(count)) finished();
      },
    });
    await all;
    // Stopping flushes the batched completions: only then are all jobs done.
    await r.stop();
    say(`done ${done}`);
    await readLine();
    await pool.end().catch(() => {}); // run() may have ended it
  },

  async work() {
    const pool = await warmPool();
    const r = await runner(pool, { wake: async () => say(`started ${now()}`) });
    say("ready");
    await readLine();
    await r.stop();
    await pool.end().catch(() => {}); // run() may have ended it
  },

  async produce() {
    const u = await utils();
    say("ready");
    while ((await readLine()) !== null) {
      const sent = now();
      await u.addJob("wake", payload);
      say(`sent ${sent}`);
    }
    await u.release();
  },
};

const [mode, ...args] = process.argv.slice(2);
await modes[mode](...args);
process.exit(0);
