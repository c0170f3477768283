"""Trims the E2B JS SDK's package.json to what its Node tests need (see run.sh)."""
import json
import sys

KEEP = {"vitest", "msw", "dotenv", "error-stack-parser-es", "@types/node"}

path = sys.argv[1]
with open(path) as f:
    pkg = json.load(f)
pkg["devDependencies"] = {k: v for k, v in pkg.get("devDependencies", {}).items() if k in KEEP}
pkg.pop("scripts", None)
with open(path, "w") as f:
    json.dump(pkg, f, indent=2)
