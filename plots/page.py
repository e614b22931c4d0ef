"""<run_dir>/plots/index.html: one page showing every picture drawn, in order."""

import html
import os

STYLE = "body{font-family:sans-serif;max-width:720px;margin:auto}img{max-width:100%}"


def write(where, run_dir, pictures):
    """pictures: [(PNG file name in `where`, caption)]. Returns the page's path."""
    name = html.escape(os.path.normpath(run_dir))
    body = "\n".join(f'<h2>{html.escape(caption)}</h2>\n<img src="{html.escape(file)}" '
                     f'alt="{html.escape(caption)}">' for file, caption in pictures)
    path = os.path.join(where, "index.html")
    with open(path, "w") as f:
        f.write(f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{name}</title>"
                f"<style>{STYLE}</style></head>\n<body><h1>{name}</h1>\n{body}\n</body></html>\n")
    return path
