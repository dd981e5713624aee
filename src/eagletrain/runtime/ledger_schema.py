"""The ledger's tables (SQLite): stages, items and their per-state counts (kept by
triggers), workers, progress samples, completion records, shards, and the regeneration
store. `CREATE ... IF NOT EXISTS` throughout: opening an older ledger adds what it lacks."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS stages(
    stage TEXT PRIMARY KEY,
    kind TEXT NOT NULL,              -- 'items' (counted per item) or 'units' (steps)
    total INTEGER NOT NULL,
    unit TEXT NOT NULL,
    units_done INTEGER NOT NULL DEFAULT 0,
    started_at REAL,
    finished_at REAL,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS items(
    stage TEXT NOT NULL,
    key TEXT NOT NULL,
    ord INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',   -- pending | done | failed | skipped
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    checksum TEXT,
    tokens INTEGER,
    bytes INTEGER,
    shard TEXT,
    offset INTEGER,
    split TEXT,
    worker TEXT,
    started_at REAL,
    finished_at REAL,
    PRIMARY KEY(stage, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS items_by_state ON items(stage, state, finished_at);
CREATE INDEX IF NOT EXISTS items_by_ord ON items(stage, ord);
CREATE INDEX IF NOT EXISTS items_by_shard ON items(stage, shard);
CREATE TABLE IF NOT EXISTS counts(
    stage TEXT NOT NULL, state TEXT NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY(stage, state)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS items_ins AFTER INSERT ON items BEGIN
    INSERT INTO counts VALUES(NEW.stage, NEW.state, 1)
        ON CONFLICT(stage, state) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS items_upd AFTER UPDATE OF state ON items
    WHEN OLD.state != NEW.state BEGIN
    UPDATE counts SET n = n - 1 WHERE stage = OLD.stage AND state = OLD.state;
    INSERT INTO counts VALUES(NEW.stage, NEW.state, 1)
        ON CONFLICT(stage, state) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS items_del AFTER DELETE ON items BEGIN
    UPDATE counts SET n = n - 1 WHERE stage = OLD.stage AND state = OLD.state;
END;
CREATE TABLE IF NOT EXISTS workers(
    id TEXT PRIMARY KEY,
    stage TEXT NOT NULL,
    partition_ TEXT NOT NULL,
    pid INTEGER NOT NULL,
    pid_start TEXT,
    host TEXT NOT NULL,
    started_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL,
    progress_at REAL,
    current TEXT,
    state TEXT NOT NULL,           -- running | exited | failed | stopped | dead
    error TEXT,
    ended_at REAL
);
CREATE INDEX IF NOT EXISTS workers_by_stage ON workers(stage, started_at);
CREATE TABLE IF NOT EXISTS progress(stage TEXT NOT NULL, t REAL NOT NULL, done INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS progress_by_time ON progress(stage, t);
CREATE TABLE IF NOT EXISTS completions(
    stage TEXT PRIMARY KEY,
    verified_at REAL NOT NULL,
    items INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    digest TEXT NOT NULL,
    allow_partial INTEGER NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS shards(
    stage TEXT NOT NULL,
    name TEXT NOT NULL,
    partition_ TEXT NOT NULL,
    state TEXT NOT NULL,           -- writing | done
    bytes INTEGER,
    PRIMARY KEY(stage, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- regenerated conversations, durable as each one finishes (and regen_partial below as each
-- turn does), so a restart re-sends nothing that was answered; tokenization into data/
-- chunks happens after
CREATE TABLE IF NOT EXISTS regenerated(
    key TEXT PRIMARY KEY,
    messages TEXT NOT NULL,          -- JSON list of {role, content[, reasoning_content]}
    finish_reasons TEXT NOT NULL,    -- JSON list, one per regenerated assistant turn
    truncated INTEGER NOT NULL,      -- a reply stopped at max_tokens
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost REAL NOT NULL,
    at REAL NOT NULL
) WITHOUT ROWID;
-- a conversation's regenerated turns so far (Regenerated.row()), replaced after each turn
-- and dropped when the conversation is whole: a stop or crash loses only turns in flight
CREATE TABLE IF NOT EXISTS regen_partial(
    key TEXT PRIMARY KEY, row TEXT NOT NULL, at REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS regen_totals(
    id INTEGER PRIMARY KEY CHECK (id = 0),
    conversations INTEGER NOT NULL, turns INTEGER NOT NULL, truncated INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, cost REAL NOT NULL
);
INSERT OR IGNORE INTO regen_totals VALUES(0, 0, 0, 0, 0, 0, 0.0);
-- prompts written by the target (data.source "self"): every text written, kept or dropped
-- with its reason, stored in the same transaction that settles its slot's item
CREATE TABLE IF NOT EXISTS self_prompts(
    slot INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    text TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    dropped TEXT,                    -- the reason, or NULL when kept
    at REAL NOT NULL,
    PRIMARY KEY(slot, attempt)
) WITHOUT ROWID;
"""
