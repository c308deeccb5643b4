// Used by tests/test_diagrams.py (FSMTRAIN_MERMAID_CHECK=tests/mermaid after `npm install` there; .ci/run does it).
// Parse a Mermaid file with Mermaid itself (in Node, on a jsdom window): prints PARSE OK and the title.
import { readFileSync } from "node:fs";
import { JSDOM } from "jsdom";
import yaml from "js-yaml";

const dom = new JSDOM("<!DOCTYPE html><body></body>", { pretendToBeVisual: true });
globalThis.window = dom.window;
globalThis.document = dom.window.document;
for (const key of ["DOMParser", "Element", "HTMLElement", "Node", "navigator"]) {
  if (!(key in globalThis)) globalThis[key] = dom.window[key];
}
const { default: mermaid } = await import("mermaid");
mermaid.initialize({ startOnLoad: false });
// Every file named on the command line, in one Node process (Mermaid takes seconds to load).
let failed = false;
for (const file of process.argv.slice(2)) {
  const text = readFileSync(file, "utf8");
  try {
    const result = await mermaid.parse(text);
    // Mermaid has parsed the front matter (a YAML error fails the parse); its title, as YAML reads it:
    const front = text.match(/^---\n([\s\S]*?)\n---\n/);
    const title = front ? (yaml.load(front[1]) || {}).title : undefined;
    console.log(`${file}: PARSE OK ${result.diagramType} title=${title ?? ""}`);
  } catch (err) {
    console.log(`${file}: PARSE FAILED ${err.message ?? err}`);
    failed = true;
  }
}
process.exit(failed ? 1 : 0);
