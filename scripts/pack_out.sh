# Sourced by run.sh and model.sh. The device machine sends back at most 8 files
# from $OUT: past that, all but the named summaries go back in one archive
# (`tar xzf all.tar.gz`). `pack_out 'a[.]md|b[.]log'`: the names to keep, as
# one extended regular expression matched against whole names.
pack_out() {
  if [ "$(ls -1 "$OUT" | wc -l)" -gt 8 ]; then
    local rest
    rest=$(cd "$OUT" && ls -1 | grep -vxE "$1|all[.]tar[.]gz")
    (cd "$OUT" && tar czf all.tar.gz $rest && rm -f $rest)
  fi
}
