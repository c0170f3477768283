// dsec function helper: transpiles one TypeScript file to CommonJS without
// type checking (as SandboxFusion's tsx does: a program that runs is not
// refused for its types). Syntax errors are reported as a compiler's and
// end with exit status 1. Usage: node ts.js IN.ts OUT.js
"use strict";
const fs = require("fs");
let ts;
try {
  ts = require("typescript");
} catch (e) {
  try {
    ts = require("/usr/share/nodejs/typescript");
  } catch (e2) {
    process.stderr.write("dsec: the TypeScript compiler is missing from this image\n");
    process.exit(3);
  }
}
const [src, out] = process.argv.slice(2);
const text = fs.readFileSync(src, "utf8");
const r = ts.transpileModule(text, {
  fileName: src,
  reportDiagnostics: true,
  compilerOptions: { module: ts.ModuleKind.CommonJS, target: ts.ScriptTarget.ES2020, esModuleInterop: true, sourceMap: false },
});
const diags = (r.diagnostics || []).filter((d) => d.category === ts.DiagnosticCategory.Error);
if (diags.length) {
  for (const d of diags) {
    const msg = ts.flattenDiagnosticMessageText(d.messageText, "\n");
    if (d.file && d.start !== undefined) {
      const { line, character } = d.file.getLineAndCharacterOfPosition(d.start);
      process.stderr.write(`${src}(${line + 1},${character + 1}): error TS${d.code}: ${msg}\n`);
    } else {
      process.stderr.write(`error TS${d.code}: ${msg}\n`);
    }
  }
  process.exit(1);
}
fs.writeFileSync(out, r.outputText);
