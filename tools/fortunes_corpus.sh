#!/usr/bin/env bash
# A real-English corpus from one Debian package: the `fortunes` files (quotations, sayings,
# verse, definitions, humour; about 2.4 MB of text in ~15 000 short documents), fetched with
# `apt-get download` (no root, nothing installed) and written as OUT_DIR/<file>.txt, one
# fortune per document between lines of `%`:
#
#   tools/fortunes_corpus.sh OUT_DIR [FILE ...]    # default: every prose file (see SKIP)
#   ode-lm prepare --source=OUT_DIR --text_delimiter='\n%\n' --tokenizer=bpe:2048 \
#       --data_dir=/tmp/ode_lm/data/fortunes
#
# Left out (SKIP): ascii-art and translate-me (not prose), ethnic and men-women (jokes on
# groups of people). The package's strfile indexes (*.dat) and its *.u8 links are skipped.
set -euo pipefail
SKIP=" ascii-art translate-me ethnic men-women "
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: tools/fortunes_corpus.sh OUT_DIR [FILE ...]" >&2
  exit 2
fi
out=$1
shift
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
  echo "fortunes_corpus: needs apt-get and dpkg-deb (Debian or Ubuntu)" >&2
  exit 1
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -q fortunes >/dev/null 2>"$work/apt.err") || {
  cat "$work/apt.err" >&2
  echo "fortunes_corpus: apt-get download fortunes failed (run apt-get update first?)" >&2
  exit 1
}
dpkg-deb -x "$work"/fortunes_*.deb "$work/x"
src=$work/x/usr/share/games/fortunes
if [ $# -eq 0 ]; then
  set --
  for f in "$src"/*; do
    name=$(basename "$f")
    case $name in *.dat | *.u8) continue ;; esac
    [ -L "$f" ] && continue
    case $SKIP in *" $name "*) continue ;; esac
    set -- "$@" "$name"
  done
fi
mkdir -p "$out"
for name in "$@"; do
  [ -f "$src/$name" ] || { echo "fortunes_corpus: no fortune file $name" >&2; exit 1; }
  cp "$src/$name" "$out/$name.txt"
done
echo "fortunes_corpus: wrote $# files to $out ($(cat "$out"/*.txt | wc -c) bytes)"
