from prefixjax.cli import run

run()
