"""The usage page's rendering (twisted_relay.usage_page): figures in, HTML out."""

from decimal import Decimal

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.usage_page import Cap, KeyUsage, dollars, render_usage_page

DAYS = ["2026-12-01", "2026-12-02", "2026-12-03"]


class DollarsTests(SynchronousTestCase):
    def test_cents_rounded_half_up(self):
        self.assertEqual(dollars(Decimal("1234.565")), "$1,234.57")
        self.assertEqual(dollars(Decimal("0.005")), "$0.01")
        self.assertEqual(dollars(Decimal(0)), "$0.00")

    def test_a_spend_under_half_a_cent_is_not_shown_as_nothing(self):
        self.assertEqual(dollars(Decimal("0.004")), "<$0.01")
        self.assertEqual(dollars(Decimal("0.000001")), "<$0.01")


class RenderTests(SynchronousTestCase):
    def page(self, keys) -> str:
        return render_usage_page(keys, DAYS, generated="now").decode("utf-8")

    def test_a_spend_under_a_cent_is_escaped_in_the_page(self):
        """``<$0.01`` is text in the page, not the start of a tag."""
        from html.parser import HTMLParser

        page = self.page([KeyUsage("dora", None, {"2026-12-02": Decimal("0.003")}, 1, 20)])
        self.assertIn('<strong id="total">&lt;$0.01</strong>', page)
        self.assertNotIn("<$", page)
        texts = []
        parser = HTMLParser()
        parser.handle_data = texts.append
        parser.feed(page)
        self.assertIn("<$0.01", texts)

    def test_each_key_its_spend_and_the_total(self):
        page = self.page(
            [
                KeyUsage("alice", "core", {"2026-12-01": Decimal("1.50"), "2026-12-03": Decimal("2.25")}, 3, 1000),
                KeyUsage("bob", None, {"2026-12-02": Decimal("0.10")}, 1, 20),
            ]
        )
        self.assertIn('<strong id="total">$3.85</strong>', page)
        self.assertIn(
            '<tr data-key="alice"><td class="name">alice</td><td class="group">core</td>'
            '<td class="spend num">$3.75</td><td class="requests num">3</td>'
            '<td class="tokens num">1,000</td>',
            page,
        )
        # The biggest spender first.
        self.assertLess(page.index('data-key="alice"'), page.index('data-key="bob"'))
        # One bar a day with spend: two for alice, one for bob.
        self.assertEqual(page.count("<rect x="), 3)

    def test_cap_colour_by_share_used(self):
        def colour(spent):
            page = self.page([KeyUsage("k", None, {}, cap=Cap(Decimal(10), "daily", Decimal(spent)))])
            return page.split('class="capbar"')[1].split('fill="')[2].split('"')[0]

        self.assertEqual(colour("7"), "#2e7d32")
        self.assertEqual(colour("8"), "#f9a825")
        self.assertEqual(colour("9.6"), "#c62828")
        self.assertEqual(colour("12"), "#c62828")

    def test_cap_label_says_whose_cap(self):
        page = self.page([KeyUsage("k", "g", {}, cap=Cap(Decimal(100), "monthly", Decimal(25), "workspace"))])
        self.assertIn("$25.00 of $100.00 monthly, its group's cap (25%)", page)

    def test_daily_cap_drawn_across_the_days(self):
        page = self.page([KeyUsage("k", None, {"2026-12-01": Decimal(5)}, cap=Cap(Decimal(10), "daily", Decimal(5)))])
        self.assertIn("<title>daily cap $10.00</title>", page)
        page = self.page([KeyUsage("k", None, {"2026-12-01": Decimal(5)}, cap=Cap(Decimal(10), "weekly", Decimal(5)))])
        self.assertNotIn("daily cap", page)

    def test_names_are_escaped(self):
        page = self.page([KeyUsage('<b>"x"</b>', "<i>", {"2026-12-01": Decimal(1)}, 1, 1)])
        self.assertNotIn("<b>", page)
        self.assertNotIn("<i>", page)
        self.assertIn("&lt;b&gt;&quot;x&quot;&lt;/b&gt;", page)

    def test_no_keys(self):
        self.assertIn('id="empty"', self.page([]))
