#!/usr/bin/env bash
# For the device tool (from the repository root, bundle.tar.xz carried): unpacks
# the bundle and runs a command line in it, with $OUT at /tmp/o, tarred back to
# the call's $OUT every 15 s as partial.tar.gz, so a machine taken back mid-call
# still returns what was written; the summaries (*.md, gpu.txt) come back loose.
#   bash scripts/device-job.sh 'GPU_TEST_QUICK=1 tests/attention hd256; PRESET=attn-hd256 bash run.sh'
set -u
real=${OUT:?the device tool sets OUT}
tar xJf bundle.tar.xz
cd bundle || exit 2
export OUT=/tmp/o
mkdir -p "$OUT"
(while sleep 15; do tar czf "$real/partial.tar.gz" -C /tmp o 2>/dev/null; done) &
snap=$!
bash -c "$1"
rc=$?
kill "$snap"
tar czf "$real/partial.tar.gz" -C /tmp o
find "$OUT" -maxdepth 2 \( -name '*.md' -o -name gpu.txt \) -exec cp {} "$real"/ \;
exit $rc
