// A retry policy for Outrigger, written in JavaScript and built with componentize-js.
//
// After an attempt of a model or tool call fails, the sidecar asks the retry hook
// what to do. This policy answers by the kind of failure:
//
// - content filtered: give up. The provider refused the content, and sending the
//   same content again, here or elsewhere, is not going to change that.
// - context overflow: fall back to the long-context target (`long_context_target`)
//   when it is one of the call's fallbacks and has not been tried yet; otherwise
//   give up, since retrying the same prompt on the same window cannot fit it.
// - rate limited with Retry-After: wait exactly that long, up to
//   `max_retry_after_ms`; a longer wait moves the call to the next fallback.
// - rate limited without Retry-After, 5xx, timeout, connection error, broken
//   stream: exponential backoff with full jitter, from `base_ms`, capped at `cap_ms`.
// - unparsable tool call: sample again at once, up to `parse_retries` times, then
//   move to the next fallback (another model may do better).
//
// Whatever the failure, it never re-sends a tool call of class `unsafe` or `probe`
// that may already have reached the tool, never retries once the host's retry
// budget is spent, and stops after `max_attempts` attempts on one target (falling
// back when a fallback is left). Attempts, backoff and parse retries count per
// target: a target fallen back to gets its own, where `ctx.attempt` counts the
// whole call. The jitter comes from the host's `random`, which the sidecar
// seeds in tests, so one input always gets one decision.
//
// Parameters (strings in the sidecar's config, `params` of the binding):
//   long_context_target  (none)   base_ms        (250)    cap_ms       (10000)
//   max_attempts         (4)      max_retry_after_ms (30000)  parse_retries (1)
//
// WIT types in JavaScript: records have camelCase fields, variants are
// `{ tag, val }` with kebab-case tags, enums are kebab-case strings, `u64` is a
// BigInt, and `option<T>` is the value or `undefined`.

import { log, random, param } from 'outrigger:policy/host@0.1.0';

const DEFAULTS = {
  long_context_target: undefined,
  base_ms: 250n,
  cap_ms: 10_000n,
  max_attempts: 4,
  max_retry_after_ms: 30_000n,
  parse_retries: 1,
};

// Parameters are fixed for an instance's life (new params make a new version), so
// they are read through the host once, on the first call.
let params;

function readParams() {
  const whole = (name, parse) => {
    const raw = param(name);
    if (raw === undefined) return DEFAULTS[name];
    try {
      const value = parse(raw.trim());
      if (value >= 0) return value;
    } catch {
      // Falls through to the warning below.
    }
    log('warn', `parameter ${name}=${JSON.stringify(raw)} is not a whole number; using the default`);
    return DEFAULTS[name];
  };
  const count = (text) => {
    if (!/^\d+$/.test(text)) throw new Error('not a count');
    return Number(text);
  };
  const target = param('long_context_target');
  return {
    longContextTarget: target === undefined || target.trim() === '' ? undefined : target.trim(),
    baseMs: whole('base_ms', BigInt),
    capMs: whole('cap_ms', BigInt),
    maxAttempts: whole('max_attempts', count),
    maxRetryAfterMs: whole('max_retry_after_ms', BigInt),
    parseRetries: whole('parse_retries', count),
  };
}

const retryAfter = (ms) => ({ tag: 'retry-after', val: ms });
const fallBack = (target) => ({ tag: 'fall-back', val: target });
const giveUp = (reason) => ({ tag: 'give-up', val: reason });

// Whether the failed attempt may have reached the upstream: only a connection that
// failed before sending is known not to have.
function mayHaveDispatched(ctx, failure) {
  return ctx.dispatched || !(failure.tag === 'connect-error' && failure.val === false);
}

// Sending a tool call again is only safe where the tool deduplicates (`keyed`) or
// does not care (`idempotent`).
function resendForbidden(ctx, failure) {
  return ctx.kind === 'tool'
    && (ctx.toolClass === 'unsafe' || ctx.toolClass === 'probe')
    && mayHaveDispatched(ctx, failure);
}

function tried(ctx, target) {
  return target === ctx.target || ctx.history.some((attempt) => attempt.target === target);
}

// The failed attempt's number on its own target: `ctx.attempt` less the attempts
// that went elsewhere before the call came to this target.
function attemptOnTarget(ctx) {
  let elsewhere = ctx.history.length;
  while (elsewhere > 0 && ctx.history[elsewhere - 1].target === ctx.target) elsewhere -= 1;
  return Math.max(ctx.attempt - elsewhere, 0);
}

// The first configured fallback this call has not tried yet.
function nextFallback(ctx) {
  return ctx.fallbacks.find((target) => !tried(ctx, target));
}

function fallBackOrGiveUp(ctx, why) {
  const target = nextFallback(ctx);
  return target === undefined ? giveUp(`${why}; no fallback left`) : fallBack(target);
}

// Full jitter: uniform in 0..=min(cap, base * 2^(attempt-1)), drawn from the host's
// (seedable) random number with a multiply-shift, which has no modulo bias.
function backoff(p, attempt) {
  const doublings = BigInt(Math.min(Math.max(attempt - 1, 0), 62));
  let ceiling = p.baseMs << doublings;
  if (ceiling > p.capMs) ceiling = p.capMs;
  return (random() * (ceiling + 1n)) >> 64n;
}

function onContextOverflow(p, ctx) {
  const target = p.longContextTarget;
  if (target === undefined) {
    return giveUp('context overflow and no long_context_target configured');
  }
  if (ctx.target === target) {
    return giveUp(`context overflow on the long-context target ${target} itself`);
  }
  if (!ctx.fallbacks.includes(target)) {
    return giveUp(`context overflow; the long-context target ${target} is not a fallback of this call`);
  }
  if (tried(ctx, target)) {
    return giveUp(`context overflow; the long-context target ${target} was already tried`);
  }
  log('info', `context overflow on ${ctx.target}; falling back to ${target}`);
  return fallBack(target);
}

function decide(ctx, failure) {
  params ??= readParams();
  const p = params;

  if (failure.tag === 'content-filtered') {
    return giveUp('content filtered by the provider; not retrying the same content');
  }
  if (resendForbidden(ctx, failure)) {
    return giveUp(`tool call of class ${ctx.toolClass} may have been dispatched; not re-sending`);
  }
  if (failure.tag === 'context-overflow') {
    return onContextOverflow(p, ctx);
  }
  const attempt = attemptOnTarget(ctx);
  if (attempt >= p.maxAttempts) {
    return fallBackOrGiveUp(ctx, `${failure.tag} after ${attempt} attempts on ${ctx.target}`);
  }
  if (!ctx.retryBudget.available) {
    return fallBackOrGiveUp(ctx, 'retry budget exhausted');
  }
  switch (failure.tag) {
    case 'rate-limited':
      if (failure.val === undefined) return retryAfter(backoff(p, attempt));
      if (failure.val > p.maxRetryAfterMs) {
        return fallBackOrGiveUp(
          ctx,
          `Retry-After ${failure.val} ms is beyond the ${p.maxRetryAfterMs} ms this policy waits`,
        );
      }
      return retryAfter(failure.val);
    case 'tool-parse-error':
      // A new sample is as likely to parse as the first one was: no need to wait.
      if (attempt <= p.parseRetries) return retryAfter(0n);
      return fallBackOrGiveUp(ctx, `unparsable tool call after ${attempt} attempts on ${ctx.target}`);
    case 'server-error':
    case 'timeout':
    case 'connect-error':
    case 'stream-interrupted':
      return retryAfter(backoff(p, attempt));
    default:
      // A failure kind newer than this policy: stop rather than guess.
      return giveUp(`unknown failure ${failure.tag}`);
  }
}

// The export named after the WIT interface `retry`.
export const retry = { decide };
