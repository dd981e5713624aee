from eagletrain.cli import app

app(prog_name="eagletrain")
