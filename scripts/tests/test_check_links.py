"""Unit tests of scripts/check_links.py on small Markdown trees written to a
temporary directory."""

import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import check_links as cl  # noqa: E402


class Slug(unittest.TestCase):
    def test_githubs_heading_ids(self):
        self.assertEqual(cl.slug("What happens to each request"), "what-happens-to-each-request")
        self.assertEqual(cl.slug("Rank by header (`rank_transport: header`)"), "rank-by-header-rank_transport-header")
        self.assertEqual(cl.slug("Prefill/decode"), "prefilldecode")
        self.assertEqual(cl.slug("dprank ÷ smg: p99, p90"), "dprank--smg-p99-p90")
        self.assertEqual(cl.slug("**Bold** and [a link](x.md) and *it*"), "bold-and-a-link-and-it")
        self.assertEqual(cl.slug("prefix_uncached_weight"), "prefix_uncached_weight", "intraword _ is no emphasis")
        self.assertEqual(cl.slug("Überblick 2"), "überblick-2")

    def test_repeated_headings_are_numbered(self):
        text = "# A\n## Notes\n## Notes\n## Notes\n"
        self.assertEqual(cl.anchors(text), {"a", "notes", "notes-1", "notes-2"})

    def test_headings_in_code_blocks_and_html_anchors(self):
        text = '```sh\n# not a heading\n```\n<a id="keep-me"></a>\n## Real\n'
        self.assertEqual(cl.anchors(text), {"keep-me", "real"})


class Links(unittest.TestCase):
    def test_inline_images_references_and_titles(self):
        text = textwrap.dedent(
            """\
            See [a](docs/a.md), ![fig](x/y.png "a title") and [b](<with space.md>).
            [ref]: docs/c.md#part
            A [link with (parens)](d_(1).md) and [ext](https://example.com).
            """
        )
        self.assertEqual(
            list(cl.links(text)),
            [
                (1, "docs/a.md"),
                (1, "x/y.png"),
                (1, "<with space.md>"),
                (2, "docs/c.md#part"),
                (3, "d_(1).md"),
                (3, "https://example.com"),
            ],
        )

    def test_link_text_over_two_lines_and_code_spans_over_two_lines(self):
        text = "Intro line\nsee [the\nguide](docs/a.md) and `a code\nspan [no](x.md)` then [b](b.md)\n\n`open\n\n[c](c.md)\n"
        self.assertEqual(list(cl.links(text)), [(3, "docs/a.md"), (4, "b.md"), (8, "c.md")])

    def test_code_is_not_a_link(self):
        text = "`[no](missing.md)` and\n```\n[no](missing.md)\n```\n~~~~\n```\n[no](x)\n~~~~\n[yes](y.md)\n"
        self.assertEqual(list(cl.links(text)), [(9, "y.md")])


class CheckFile(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.root = Path(tmp.name) / "repo"
        (self.root / "docs").mkdir(parents=True)
        (self.root / "src").mkdir()
        (self.root / "src" / "lib.rs").write_text("")
        (self.root / "docs" / "guide.md").write_text("# Guide\n\n## Set up `it`\n\n[back](../README.md#dprank)\n")
        (self.root.parent / "outside.md").write_text("# Out\n")

    def problems(self, readme):
        (self.root / "README.md").write_text(readme)
        return cl.check([self.root / "README.md"], self.root)

    def test_good_links_pass(self):
        readme = (
            "# dprank\n\n[guide](docs/guide.md), [its part](docs/guide.md#set-up-it), [here](#dprank),\n"
            "[src](src/), [lib](src/lib.rs#L1), [web](https://example.com/x#y), [mail](mailto:a@b.c).\n"
        )
        self.assertEqual(self.problems(readme), [])
        self.assertEqual(cl.check([self.root / "docs" / "guide.md"], self.root), [])

    def test_each_kind_of_broken_link_is_reported_with_its_line(self):
        readme = (
            "# dprank\n"
            "[gone](docs/missing.md)\n"
            "[bad anchor](docs/guide.md#set-up)\n"
            "[bad local anchor](#nowhere)\n"
            "[escapes](../outside.md)\n"
            "[absolute](/README.md)\n"
            "![figure](docs/missing.png)\n"
        )
        problems = self.problems(readme)
        self.assertEqual(len(problems), 6, problems)
        self.assertTrue(problems[0].startswith("README.md:2: docs/missing.md: no such file"))
        self.assertIn("README.md:3: docs/guide.md#set-up: no heading or anchor #set-up in docs/guide.md", problems[1])
        self.assertIn("README.md:4: #nowhere: no heading", problems[2])
        self.assertIn("README.md:5: ../outside.md: points outside the repository", problems[3])
        self.assertIn("README.md:6: /README.md: absolute path", problems[4])
        self.assertIn("README.md:7: docs/missing.png: no such file", problems[5])

    def test_a_missing_file_to_check_is_a_problem(self):
        self.assertEqual(cl.check([self.root / "nope.md"], self.root), ["nope.md: file to check does not exist"])

    def test_default_set_covers_readme_and_docs(self):
        (self.root / "README.md").write_text("# x\n")
        names = [str(p.relative_to(self.root)) for p in cl.default_files(self.root)]
        self.assertEqual(names[:2], ["README.md", "docs/guide.md"])
        self.assertIn("envoy/README.md", names)


if __name__ == "__main__":
    unittest.main()
