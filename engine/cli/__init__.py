"""The `nmt-incremental` command: one module per subcommand group (`translate`, `replay`,
`logs`, `serve`, `models` with its `export` stages), `args` for the options they share,
`main` for the parser and dispatch."""
