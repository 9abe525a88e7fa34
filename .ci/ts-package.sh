#!/usr/bin/env bash
# The TypeScript client (supabase/functions/_shared/idempotency) packaged as
# its ecosystems take it, and the packages tried as a user would:
#
#   JSR  deno publish --dry-run: the TypeScript source with jsr.json (the
#        license, no slow types in the public API).
#   npm  tsc compiles ES modules and declarations into target/ts-package/;
#        npm pack --dry-run must list exactly package.json, README.md,
#        LICENSE and dist/ (each module with its declarations, and the JSON
#        tables); the packed tarball is installed into a scratch project,
#        where tsc type-checks tests/node_check.ts and the package README's
#        example against the installed package, and Node runs the check: the request-hash vectors and, with
#        IDEM_POSTGREST_URL and IDEM_SERVICE_KEY set (tests/run.sh sets
#        them), a claim journaled and replayed on the plane.
#
# Copying the folder and importing mod.ts by relative path, as Edge
# Functions share code, needs none of this. Run by tests/run.sh; by hand:
# bash .ci/ts-package.sh. Exits non-zero on any failure.
set -euo pipefail

TYPES_NODE_VERSION=20.19.43

root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=/dev/null
. "$root/.ci/js-tools.sh"
say() { echo "ts-package: $*"; }
fail() {
  echo "ts-package: $*" >&2
  exit 1
}
client="$root/supabase/functions/_shared/idempotency"
out="$root/target/ts-package"
rm -rf "$out"
mkdir -p "$out/package" "$out/consumer"

say "jsr.json and package.json name the same package"
node --input-type=module - "$client" <<'JS'
import { readFileSync } from "node:fs";
const read = (file) => JSON.parse(readFileSync(`${process.argv[2]}/${file}`, "utf8"));
const [jsr, npm] = [read("jsr.json"), read("package.json")];
for (const field of ["name", "version", "license"]) {
  if (jsr[field] !== npm[field]) {
    console.error(`ts-package: jsr.json's ${field} ${jsr[field]} is not package.json's ${npm[field]}`);
    process.exit(1);
  }
}
JS

say "JSR: deno publish --dry-run"
# --allow-dirty: a working tree with changes is checked as it is.
(cd "$client" && "$DENO" publish --dry-run --allow-dirty)

say "npm: compiling with tsc $("$TSC" --version | sed 's/^Version //')"
"$TSC" -p "$root/.ci/ts-package/tsconfig.json" --outDir "$out/package/dist"
# tsc rewrites the modules' relative imports from .ts to .js but leaves the
# declarations' as the source wrote them: give them the .js the package has.
sed -i -E 's#((from|import) "\./[A-Za-z0-9_]+)\.ts"#\1.js"#g' "$out/package/dist"/*.d.ts
if grep -l '\.ts"' "$out/package/dist"/*.d.ts; then
  fail "a declaration still imports a .ts file"
fi
cp "$client/package.json" "$client/README.md" "$root/LICENSE" "$out/package/"

say "npm: npm pack --dry-run"
(cd "$out/package" && npm pack --dry-run --json --loglevel=error) >"$out/pack.json"
node --input-type=module - "$out/pack.json" "$client" <<'JS'
import { readFileSync, readdirSync } from "node:fs";
const [packJson, client] = process.argv.slice(2);
const [pack] = JSON.parse(readFileSync(packJson, "utf8"));
const shipped = pack.files.map((f) => f.path).sort();
const expected = ["LICENSE", "README.md", "package.json"];
for (const file of readdirSync(client).sort()) {
  if (file.endsWith(".ts")) expected.push(`dist/${file.replace(/\.ts$/, ".js")}`, `dist/${file.replace(/\.ts$/, ".d.ts")}`);
  else if (file.endsWith(".json") && !["package.json", "jsr.json"].includes(file)) expected.push(`dist/${file}`);
}
expected.sort();
const missing = expected.filter((f) => !shipped.includes(f));
const extra = shipped.filter((f) => !expected.includes(f));
if (missing.length || extra.length) {
  console.error(`ts-package: npm pack ships the wrong files: missing ${JSON.stringify(missing)}, extra ${JSON.stringify(extra)}`);
  process.exit(1);
}
console.log(`ts-package: ${pack.name}@${pack.version}: ${shipped.length} files, ${pack.size} bytes packed`);
JS
(cd "$out/package" && npm pack --pack-destination "$out" --loglevel=error >/dev/null)
tarball="$(ls "$out"/*.tgz)"

say "npm: installing $(basename "$tarball") into a scratch project"
cd "$out/consumer"
echo '{"private": true, "type": "module"}' >package.json
npm install --no-audit --no-fund --loglevel=error "$tarball" "@types/node@$TYPES_NODE_VERSION"
# The Node check as a user of the package writes it: the package's name for
# the relative path, the vectors where they are.
sed -e 's#"\.\./_shared/idempotency/mod\.ts"#"@idempotency-plane/client"#' \
  -e "s#new URL(\"\\.\\./\\.\\./\\.\\./tests/vectors/request_hash\\.json\", import\\.meta\\.url)#\"$root/tests/vectors/request_hash.json\"#" \
  "$root/supabase/functions/tests/node_check.ts" >node_check.ts
grep -q '"@idempotency-plane/client"' node_check.ts || fail "node_check.ts no longer imports ../_shared/idempotency/mod.ts"
grep -q "\"$root/tests/vectors/request_hash.json\"" node_check.ts || fail "node_check.ts no longer reads the vectors by URL"
# The package README's example, as a user pastes it, with what it leaves
# to the user declared.
{
  echo 'declare const organizationId: string, messageId: string, to: string;'
  echo 'declare function sendEmail(to: string): Promise<{ id: string }>;'
  # The first ```ts block, without its fences.
  awk '/^```ts$/ && !seen { inside = 1; seen = 1; next } inside && /^```$/ { exit } inside' "$client/README.md"
} >readme_example.ts
grep -q '@idempotency-plane/client' readme_example.ts || fail "README.md has no TypeScript example importing the package"
cat >tsconfig.json <<'JSON'
{
  "compilerOptions": {
    "target": "ES2022",
    "module": "NodeNext",
    "moduleResolution": "NodeNext",
    "lib": ["ES2022"],
    "types": ["node"],
    "strict": true,
    "noEmit": true
  },
  "files": ["node_check.ts", "readme_example.ts"]
}
JSON
say "npm: tsc type-checks node_check.ts and the README's example against the installed package"
"$TSC" -p tsconfig.json
say "npm: node $(node --version) runs it"
"$TSX" node_check.ts
say "all passed"
