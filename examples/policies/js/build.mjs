// Builds policy.js into a WebAssembly component for the `retry-policy` world:
//
//   node build.mjs OUT.wasm
//
// The componentize-js API is used rather than the `jco componentize` command, which
// cannot read its input files with the WASI shim version npm resolves for it. Every
// WASI feature of the JavaScript engine is disabled, so the component imports the
// policy host and nothing else: no console, clock, randomness or network of its own
// (the host's `random` and `log` stand in for Math.random and console.log).
import { componentize } from '@bytecodealliance/componentize-js';
import { rename, writeFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { dirname, join, resolve } from 'node:path';

const here = dirname(fileURLToPath(import.meta.url));
const out = process.argv[2];
if (!out) {
  console.error('usage: node build.mjs OUT.wasm');
  process.exit(2);
}

const { component, imports } = await componentize({
  sourcePath: join(here, 'policy.js'),
  witPath: resolve(here, '../../../wit'),
  worldName: 'retry-policy',
  disableFeatures: ['stdio', 'random', 'clocks', 'http', 'fetch-event'],
});

// Written next to the result and renamed into place, so a sidecar watching the
// folder never picks up a half-written component.
const partial = `${out}.partial`;
await writeFile(partial, component);
await rename(partial, out);
const imported = [...new Set(imports.map(([name]) => name))];
console.error(`built ${out} (${component.length} bytes; imports ${imported.join(', ') || 'none'})`);
