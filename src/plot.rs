//! A small SVG line chart, written by hand so plotting needs no font or image libraries: one
//! polyline per series over shared numeric axes, with ticks, labels and a legend. Used for
//! `eval --plot` (quality against FFN bytes per token).

use std::fmt::Write;

pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub series: Vec<Series>,
}

const W: f64 = 900.0;
const H: f64 = 560.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Round tick steps: 1, 2 or 5 times a power of ten, about `n` of them over the span.
fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 {
        out.push(t);
        t += step;
    }
    out
}

impl Chart<'_> {
    pub fn svg(&self) -> String {
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in pts {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
        if x0 > x1 {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        let pad = |a: f64, b: f64| ((b - a) * 0.05).max(1e-9);
        let (px, py) = (pad(x0, x1), pad(y0, y1));
        let (x0, x1, y0, y1) = (x0 - px, x1 + px, y0 - py, y1 + py);
        let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT);
        let sy = |y: f64| H - BOTTOM - (y - y0) / (y1 - y0) * (H - TOP - BOTTOM);
        let mut o = String::new();
        let _ = writeln!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(o, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let _ = writeln!(
            o,
            r#"<text x="{}" y="28" text-anchor="middle" font-size="16">{}</text>"#,
            W / 2.0,
            escape(self.title)
        );
        let (left, right, top, bottom) = (LEFT, W - RIGHT, TOP, H - BOTTOM);
        let _ = writeln!(
            o,
            r##"<rect x="{left}" y="{top}" width="{}" height="{}" fill="none" stroke="#333"/>"##,
            right - left,
            bottom - top
        );
        let label = |ts: &[f64], t: f64| {
            let step = if ts.len() > 1 { ts[1] - ts[0] } else { 1.0 };
            let decimals = (-step.log10().floor()).max(0.0) as usize;
            format!("{:.*}", decimals, t + 0.0)
        };
        let xt = ticks(x0, x1, 8);
        for &t in &xt {
            let x = sx(t);
            let t = label(&xt, t);
            let _ = writeln!(
                o,
                r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{bottom}" stroke="#eee"/><text x="{x:.1}" y="{}" text-anchor="middle">{t}</text>"##,
                bottom + 16.0
            );
        }
        let yt = ticks(y0, y1, 8);
        for &t in &yt {
            let y = sy(t);
            let t = label(&yt, t);
            let _ = writeln!(
                o,
                r##"<line x1="{left}" y1="{y:.1}" x2="{right}" y2="{y:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{t}</text>"##,
                left - 6.0,
                y + 4.0
            );
        }
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            (left + right) / 2.0,
            H - 16.0,
            escape(self.x_label)
        );
        let _ = writeln!(
            o,
            r#"<text transform="translate(20 {}) rotate(-90)" text-anchor="middle">{}</text>"#,
            (top + bottom) / 2.0,
            escape(self.y_label)
        );
        for (i, s) in self.series.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            let mut points = s.points.clone();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let path: Vec<String> = points
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
                .collect();
            let _ = writeln!(
                o,
                r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"/>"#,
                path.join(" ")
            );
            for &(x, y) in &points {
                let _ = writeln!(o, r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{c}"/>"#, sx(x), sy(y));
            }
            let ly = top + 10.0 + 20.0 * i as f64;
            let _ = writeln!(
                o,
                r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
                right + 15.0,
                right + 40.0,
                right + 46.0,
                ly + 4.0,
                escape(&s.name)
            );
        }
        o.push_str("</svg>\n");
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_has_a_line_per_series_and_escapes_text() {
        let c = Chart {
            title: "a < b",
            x_label: "x",
            y_label: "y",
            series: vec![
                Series {
                    name: "one".into(),
                    points: vec![(0.0, 1.0), (1.0, 2.0)],
                },
                Series {
                    name: "two & three".into(),
                    points: vec![(0.5, 0.5)],
                },
            ],
        };
        let svg = c.svg();
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a &lt; b") && svg.contains("two &amp; three"));
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        let t = ticks(0.0, 1.0, 5);
        assert_eq!(t.len(), 6);
        assert!(
            t.iter()
                .zip([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
                .all(|(a, b)| (a - b).abs() < 1e-9),
            "{t:?}"
        );
    }
}
